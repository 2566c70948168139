"""Image classification datasets from the Hugging Face Hub (``--dataset uoft-cs/cifar10``) through ``datasets``.

``datasets.load_dataset`` keeps the download in the HF cache (``HF_HOME``, ``HF_DATASETS_CACHE``), so after one run
online ``HF_DATASETS_OFFLINE=1`` runs work from it; a local folder in the Hub's layout (``data/train-*.parquet``) or one
written by ``save_to_disk`` loads the same way. The images are decoded once into uint8 pixels with ``Dataset.map``,
which the HF cache also keeps, so later runs skip the decoding too.
"""

from __future__ import annotations

import torch

from acceltrain.config.options import ConfigError, first_line
from acceltrain.runtime.distributed import on_main_process_first

EVAL_SPLITS = ("test", "validation")


def hub_image_arrays(name: str, image_size: int) -> tuple[tuple[torch.Tensor, list[int], list[str]], ...]:
    """``(train, eval)`` of Hub dataset ``name``, each ``(uint8 images (N, 3, S, S), labels, class names)``: the
    one image and one ``ClassLabel`` column, found by their feature types; the ``train`` split, and ``test``
    (else ``validation``) for evaluation. Loaded and decoded by the main process first; the others read its cache."""
    return on_main_process_first(lambda: _load(name, image_size))


def _load(name: str, image_size: int):
    import datasets

    try:
        splits = datasets.load_dataset(name)
    except (OSError, ValueError) as err:  # offline and not cached, unknown repo, no data files, bad id
        raise ConfigError(
            f"--dataset {name!r} cannot be loaded ({first_line(err)}): download it once online (it is then kept in the "
            "HF cache, and HF_DATASETS_OFFLINE=1 runs use it), or use --dataset imagefolder --data-dir DIR, or "
            "--dataset synthetic"
        ) from None
    if "train" not in splits:
        raise ConfigError(f"--dataset {name!r} has no train split (it has {', '.join(splits)})")
    eval_split = next((split for split in EVAL_SPLITS if split in splits), None)
    if eval_split is None:
        raise ConfigError(
            f"--dataset {name!r} has no test or validation split to evaluate on (it has {', '.join(splits)})"
        )
    features = splits["train"].features
    image_column = _only_column(name, features, datasets.Image, "image")
    label_column = _only_column(name, features, datasets.ClassLabel, "ClassLabel label")
    classes = list(features[label_column].names)
    return tuple(
        _pixels(name, splits[split], split, image_column, label_column, image_size) + (classes,)
        for split in ("train", eval_split)
    )


def _only_column(name: str, features, kind: type, what: str) -> str:
    found = [column for column, feature in features.items() if isinstance(feature, kind)]
    if len(found) != 1:
        listed = ", ".join(f"{column} ({type(feature).__name__})" for column, feature in features.items())
        count = "no" if not found else f"{len(found)}"
        raise ConfigError(
            f"--dataset {name!r} has {count} {what} columns, and acceltrain needs exactly one: its columns are {listed}"
        )
    return found[0]


def _pixels(
    name: str, split_set, split: str, image_column: str, label_column: str, image_size: int
) -> tuple[torch.Tensor, list[int]]:
    """The split's images as uint8 (N, 3, S, S), decoded by ``Dataset.map`` (cached in the HF cache), and its labels."""
    import datasets

    labels = list(split_set[label_column])
    if min(labels, default=0) < 0:
        raise ConfigError(
            f"--dataset {name!r}: its {split} split has unlabelled samples (label -1); it cannot be trained or "
            "evaluated on"
        )
    features = datasets.Features({"pixels": datasets.Array3D((3, image_size, image_size), "uint8")})
    decoded = split_set.map(
        _to_pixels,
        batched=True,
        fn_kwargs={"column": image_column, "image_size": image_size},
        remove_columns=split_set.column_names,
        features=features,
        desc=f"decoding {split} images",
    )
    images = decoded.with_format("torch", dtype=torch.uint8)[:]["pixels"]  # torch's default for integers is int64
    return images, labels


def _to_pixels(batch: dict, column: str, image_size: int) -> dict:
    """Dataset.map: PIL images -> RGB CHW uint8 arrays of ``image_size`` (converted as image files are)."""
    from acceltrain.vision.images import rgb_chw

    return {"pixels": [rgb_chw(image, image_size) for image in batch[column]]}

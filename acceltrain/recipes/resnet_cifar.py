"""A ResNet or the fast airbench94 net on CIFAR-10 (or any ImageFolder tree, or synthetic data) with the
acceltrain loop.

    accelerate launch -m acceltrain.recipes.resnet_cifar --config resnet18_cifar_94
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/resnet_cifar.py --config cifar10_fast
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/resnet_cifar.py
    acceltrain-resnet-cifar --dataset synthetic --model resnet_tiny --max-steps 20

Every flag: acceltrain-resnet-cifar --help (or python recipes/resnet_cifar.py --help in a checkout)
"""

from dataclasses import dataclass

from acceltrain import TrainConfig, option, require, run_recipe
from acceltrain.vision import FLIPS, IMAGE_DATASETS, MODELS, PADDING_MODES, STEMS, TTA_MODES, is_hub_dataset

__all__ = ["CifarConfig", "cli", "main"]

WHITENING_IMAGES = 5000  # airbench's count: plenty for the covariance of 2x2 or 3x3 patches, and quick


@dataclass
class CifarConfig(TrainConfig):
    model: str = option(
        "resnet18", "network; fast_cifar: airbench94's 2M-parameter net (see cifar10_fast.yaml)", choices=MODELS
    )
    stem: str = option(
        "cifar", "ResNets: cifar: 3x3 conv, no max-pool; imagenet: torchvision's 7x7/2 conv + max-pool", choices=STEMS
    )
    dataset: str = option(
        "cifar10",
        "cifar10 (torchvision download), imagefolder (--data-dir), synthetic, or a Hub image-classification "
        "dataset as namespace/name (e.g. uoft-cs/cifar10; HF cache, HF_DATASETS_OFFLINE=1 after one download)",
    )
    data_dir: str | None = option(
        None,
        "dataset folder (cifar10: default ./data; imagefolder: train/<class>/* and test/<class>/*)",
        free_on_resume=True,
    )
    skip_bad_images: bool = option(
        False,
        "imagefolder: leave out files that are no readable image (empty, cut short, not an image) instead of "
        "refusing to start; says how many",
        free_on_resume=True,
    )
    label_smoothing: float = option(0.0, "label smoothing for the cross-entropy loss")
    crop_padding: int = option(4, "random crop: translate training images by up to this many pixels each way")
    crop_padding_mode: str = option(
        "zeros", "what a crop brings in at the edges: zeros, or reflect (the image mirrored)", choices=PADDING_MODES
    )
    flip: str = option(
        "random",
        "training flips: random (drawn each epoch), alternating (epoch 0's random flip, inverted on odd epochs: "
        "each image seen both ways every two epochs) or none",
        choices=FLIPS,
    )
    whiten_first_conv: bool = option(
        False,
        f"set the first conv's filters from the patch covariance of {WHITENING_IMAGES} training images "
        "(whitened principal directions and their negations) and freeze them",
    )
    freeze_whitening_bias_after_epochs: int | None = option(
        None,
        "--whiten-first-conv: stop training the whitening conv's bias after this many epochs (airbench94: 3)",
    )
    tta: str = option(
        "none",
        "test-time augmentation in evaluations: flip (mean logits of the image and its mirror), flip-translate "
        "(also 1-pixel shifts) or none",
        choices=TTA_MODES,
    )
    ema_decay: float | None = option(
        None, "evaluate and export an exponential moving average of the weights with this decay per step"
    )
    lookahead_decay: float | None = option(
        None,
        "airbench's lookahead: every --lookahead-every steps, set the weights to their moving average with this "
        "decay per step, ramped up as (fraction of the run done)^3; the run ends on the average (0.95 in cifar10_fast)",
    )
    lookahead_every: int = option(5, "steps between two lookahead updates")

    def validate(self) -> None:
        super().validate()
        require(
            self.dataset in IMAGE_DATASETS or is_hub_dataset(self.dataset),
            "dataset",
            self.dataset,
            f"one of {', '.join(IMAGE_DATASETS)}, or a Hub dataset as namespace/name (e.g. uoft-cs/cifar10)",
        )
        require(0 <= self.label_smoothing < 1, "label_smoothing", self.label_smoothing, "a number in [0, 1)")
        require(self.crop_padding >= 0, "crop_padding", self.crop_padding, "an integer >= 0")
        for name in ("ema_decay", "lookahead_decay"):
            if getattr(self, name) is not None:
                require(0 < getattr(self, name) < 1, name, getattr(self, name), "a number in (0, 1)")
        require(self.lookahead_every >= 1, "lookahead_every", self.lookahead_every, "an integer >= 1")
        if self.freeze_whitening_bias_after_epochs is not None:
            require(
                self.freeze_whitening_bias_after_epochs >= 0,
                "freeze_whitening_bias_after_epochs",
                self.freeze_whitening_bias_after_epochs,
                "an integer >= 0",
            )
            require(
                self.whiten_first_conv,
                "freeze_whitening_bias_after_epochs",
                self.freeze_whitening_bias_after_epochs,
                "unset without --whiten-first-conv (there is no whitening conv)",
            )


def main(cfg: CifarConfig) -> dict:
    # imported here, not at the top: --help and bad flags answer in a fraction of a second, without torch
    from acceltrain import EMA, ClassificationTask, ConfigError, Lookahead, build_optimizer, fit
    from acceltrain.vision import (
        CropFlip,
        FreezeAfterEpochs,
        build_model,
        image_datasets,
        whiten_first_conv,
        whitening_images,
    )

    augment = CropFlip(cfg.crop_padding, cfg.flip, cfg.crop_padding_mode)
    train_set, eval_set = image_datasets(
        cfg.dataset,
        cfg.data_dir,
        seed=cfg.seed,
        augment=augment,
        skip_bad_images=cfg.skip_bad_images,
        progress=cfg.progress,
    )
    augment.check_image_size(train_set.image_size, train_set.image_size)
    model = build_model(cfg.model, num_classes=len(train_set.classes), stem=cfg.stem)
    whitening = None
    if cfg.whiten_first_conv:  # before the optimizer is built, which leaves the frozen weights out
        whitening = whiten_first_conv(model, whitening_images(train_set, WHITENING_IMAGES, seed=cfg.seed))
    optimizer = build_optimizer(model, cfg)
    task = ClassificationTask(label_smoothing=cfg.label_smoothing, tta=cfg.tta)
    hooks = [EMA(decay=cfg.ema_decay)] if cfg.ema_decay is not None else []
    if cfg.lookahead_decay is not None:
        hooks.append(Lookahead(decay=cfg.lookahead_decay, every=cfg.lookahead_every))
    if cfg.freeze_whitening_bias_after_epochs is not None:  # after the lookahead, whose updates it undoes
        if whitening.bias is None:
            raise ConfigError(
                f"--freeze-whitening-bias-after-epochs {cfg.freeze_whitening_bias_after_epochs}: {cfg.model}'s "
                "first conv has no bias to freeze (fast_cifar's has one)"
            )
        hooks.append(FreezeAfterEpochs(whitening.bias, cfg.freeze_whitening_bias_after_epochs))
    return fit(cfg, model, optimizer, train_set, eval_set, task=task, hooks=hooks, name="resnet_cifar")


def cli() -> None:
    """The command line (console script, ``python -m``, ``accelerate launch``); returns nothing, so that the
    console script's ``sys.exit(cli())`` exits 0."""
    run_recipe(main, CifarConfig, description=__doc__)


if __name__ == "__main__":
    cli()

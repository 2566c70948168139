"""The choices of the image flags, without torch: a recipe's config class (and so its ``--help`` and its
config errors) is built from them before anything heavy is imported."""

FLIPS = ("random", "alternating", "none")
PADDING_MODES = ("zeros", "reflect")
IMAGE_DATASETS = ("cifar10", "imagefolder", "synthetic")  # and any Hub dataset as namespace/name (hub_datasets.py)
RESNETS = ("resnet18", "resnet34", "resnet50", "resnet_tiny")
MODELS = (*RESNETS, "fast_cifar")
STEMS = ("cifar", "imagenet")
TTA_MODES = ("none", "flip", "flip-translate")  # ClassificationTask(tta=...)


def is_hub_dataset(name: str) -> bool:
    """A ``--dataset`` value naming a Hub dataset (``namespace/name``) or a local dataset folder (a path)."""
    return "/" in name

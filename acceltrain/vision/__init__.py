"""Images: datasets and augmentation keyed on ``(seed, epoch, index)``, the on-device loader, ResNets."""

from .data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    IMAGE_DATASETS,
    CropFlip,
    ImageClassification,
    image_datasets,
    synthetic_images,
)
from .device_loader import DeviceImageLoader
from .models import RESNETS, STEMS, TinyResNet, build_resnet

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "IMAGE_DATASETS",
    "RESNETS",
    "STEMS",
    "CropFlip",
    "DeviceImageLoader",
    "ImageClassification",
    "TinyResNet",
    "build_resnet",
    "image_datasets",
    "synthetic_images",
]

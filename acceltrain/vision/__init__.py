"""Images: datasets and augmentation keyed on ``(seed, epoch, index)``, the on-device loader, ResNets and a
fast CIFAR net, whitening initialisation."""

from .data import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    FLIPS,
    IMAGE_DATASETS,
    PADDING_MODES,
    CropFlip,
    ImageClassification,
    image_datasets,
    synthetic_images,
)
from .device_loader import DeviceImageLoader
from .fast_net import FastCifarNet
from .models import MODELS, RESNETS, STEMS, TinyResNet, build_model, build_resnet
from .whitening import whiten_first_conv, whitening_images

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "FLIPS",
    "IMAGE_DATASETS",
    "MODELS",
    "PADDING_MODES",
    "RESNETS",
    "STEMS",
    "CropFlip",
    "DeviceImageLoader",
    "FastCifarNet",
    "ImageClassification",
    "TinyResNet",
    "build_model",
    "build_resnet",
    "image_datasets",
    "synthetic_images",
    "whiten_first_conv",
    "whitening_images",
]

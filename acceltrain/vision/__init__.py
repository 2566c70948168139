"""Images: datasets and augmentation keyed on ``(seed, epoch, index)``, the on-device loader, ResNets and a
fast CIFAR net, whitening initialisation. Names are imported on first use (see ``acceltrain.lazy_exports``)."""

from acceltrain.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "FLIPS": "names",
        "IMAGE_DATASETS": "names",
        "MODELS": "names",
        "PADDING_MODES": "names",
        "RESNETS": "names",
        "STEMS": "names",
        "TTA_MODES": "names",
        "is_hub_dataset": "names",
        "CIFAR10_MEAN": "data",
        "CIFAR10_STD": "data",
        "CropFlip": "augment",
        "ImageClassification": "data",
        "image_datasets": "data",
        "synthetic_images": "data",
        "DeviceImageLoader": "device_loader",
        "FastCifarNet": "fast_net",
        "TinyResNet": "models",
        "build_model": "models",
        "build_resnet": "models",
        "FreezeAfterEpochs": "whitening",
        "whiten_first_conv": "whitening",
        "whitening_images": "whitening",
    },
)

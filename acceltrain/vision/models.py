"""Image classifiers: torchvision ResNets with a CIFAR stem (3x3 conv, no max-pool) or the ImageNet stem,
a tiny ResNet for smoke tests and CPU runs, and airbench's fast CIFAR net (:mod:`.fast_net`)."""

from __future__ import annotations

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

from acceltrain.config.options import ConfigError
from acceltrain.hf.hub import loadable
from acceltrain.vision.fast_net import FastCifarNet
from acceltrain.vision.names import MODELS, RESNETS, STEMS


class TinyResNet(nn.Module):
    """Three stages of one basic block each (16/32/64 channels): about 80k parameters."""

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages, channels = [], width
        for stage_index in range(3):
            out_channels = width * 2**stage_index
            stride = 1 if stage_index == 0 else 2
            downsample = None
            if stride != 1 or channels != out_channels:
                downsample = nn.Sequential(
                    nn.Conv2d(channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
                )
            stages.append(BasicBlock(channels, out_channels, stride=stride, downsample=downsample))
            channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def build_resnet(name: str, num_classes: int = 10, stem: str = "cifar") -> nn.Module:
    """A freshly initialised ResNet; the CIFAR stem keeps 32x32 inputs at full resolution in stage 1."""
    if name not in RESNETS:
        raise ConfigError(f"--model {name!r} is invalid: choose one of {', '.join(RESNETS)}")
    if stem not in STEMS:
        raise ConfigError(f"--stem {stem!r} is invalid: choose one of {', '.join(STEMS)}")
    if name == "resnet_tiny":
        return TinyResNet(num_classes)
    import torchvision.models

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


@loadable(
    "acceltrain.vision.build_model", pipeline_tag="image-classification"
)  # acceltrain.hf.hub.load_model() rebuilds it
def build_model(name: str, num_classes: int = 10, stem: str = "cifar") -> nn.Module:
    """Any of ``MODELS``, freshly initialised: a ResNet (:func:`build_resnet`) or the fast CIFAR net, which
    has its own stem."""
    if name not in MODELS:
        raise ConfigError(f"--model {name!r} is invalid: choose one of {', '.join(MODELS)}")
    if name in RESNETS:
        return build_resnet(name, num_classes, stem)
    if stem != "cifar":
        raise ConfigError(
            f"--stem {stem!r} is invalid for --model {name}, which has its own stem: --stem applies to the ResNets"
        )
    return FastCifarNet(num_classes)

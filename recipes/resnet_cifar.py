"""The ResNet / fast-net CIFAR-10 recipe, from a checkout: the recipe itself is acceltrain/recipes/resnet_cifar.py
(installed with the package as acceltrain-resnet-cifar and ``-m acceltrain.recipes.resnet_cifar``).

    accelerate launch recipes/resnet_cifar.py --config recipes/configs/resnet18_cifar_94.yaml
    python recipes/resnet_cifar.py --help
"""

from acceltrain.recipes.resnet_cifar import CifarConfig, cli, main

__all__ = ["CifarConfig", "cli", "main"]

if __name__ == "__main__":
    cli()

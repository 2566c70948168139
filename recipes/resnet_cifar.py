"""ResNet on CIFAR-10 (or any ImageFolder tree, or synthetic data) with the acceltrain loop.

    accelerate launch recipes/resnet_cifar.py --config recipes/configs/resnet18_cifar_94.yaml
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/resnet_cifar.py
    python recipes/resnet_cifar.py --dataset synthetic --model resnet_tiny --max-steps 20

Every flag: python recipes/resnet_cifar.py --help
"""

from dataclasses import dataclass

from acceltrain import ClassificationTask, TrainConfig, build_optimizer, fit, option, require, run_recipe
from acceltrain.vision import IMAGE_DATASETS, RESNETS, STEMS, build_resnet, image_datasets


@dataclass
class CifarConfig(TrainConfig):
    model: str = option("resnet18", "network", choices=RESNETS)
    stem: str = option("cifar", "cifar: 3x3 conv, no max-pool; imagenet: torchvision's 7x7/2 conv + max-pool", choices=STEMS)
    dataset: str = option("cifar10", "cifar10 (torchvision download), imagefolder (--data-dir) or synthetic", choices=IMAGE_DATASETS)
    data_dir: str | None = option(
        None, "dataset folder (cifar10: default ./data; imagefolder: train/<class>/* and test/<class>/*)", free_on_resume=True
    )
    label_smoothing: float = option(0.0, "label smoothing for the cross-entropy loss")

    def validate(self) -> None:
        super().validate()
        require(0 <= self.label_smoothing < 1, "label_smoothing", self.label_smoothing, "a number in [0, 1)")


def main(cfg: CifarConfig) -> dict:
    train_set, eval_set = image_datasets(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    model = build_resnet(cfg.model, num_classes=len(train_set.classes), stem=cfg.stem)
    optimizer = build_optimizer(model, cfg)
    task = ClassificationTask(label_smoothing=cfg.label_smoothing)
    return fit(cfg, model, optimizer, train_set, eval_set, task=task, name="resnet_cifar")


if __name__ == "__main__":
    run_recipe(main, CifarConfig, description=__doc__)

"""How fast can each loader hand the training loop READY batches (cropped, flipped, normalised, on the
training device)? Images/s at batch 256 on the real CIFAR-10 JPEGs, for:

  (a) torchvision ImageFolder + RandomCrop(32, padding=4) + RandomHorizontalFlip + ToTensor + Normalize
      through a DataLoader, with the best num_workers of 0, 1, 2: the usual baseline;
  (b) acceltrain's DataLoader path (image_datasets("imagefolder") + train_loader), best of 0, 1, 2 workers;
  (c) acceltrain's DeviceImageLoader (--data-on-device): uint8 set on the device, batched augmentation.

Each is timed over 3 windows of 40 batches after one warm-up batch (best window: the machine may be
shared); the device loader's one-off decode + cache (cold) and cache read (warm) are reported apart.
Target: (c) >= 20x (a). On a CUDA machine the device is the GPU and (a)/(b) batches are copied there
(pinned memory), so that every row counts batches ready on the training device.

    python benchmarks/loader.py            # -> benchmarks/results/loader.json
"""

from __future__ import annotations

import os
import time

import torch
from common import cifar10_jpeg, start, verdict, write_result
from torch.utils.data import DataLoader

BATCH_SIZE, TIMED_BATCHES, REPEATS, WORKER_CHOICES, TARGET = 256, 40, 3, (0, 1, 2), 20.0
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# One intra-op thread in this process: the per-sample ops of (a)/(b) are below PyTorch's parallel grain
# size anyway (and DataLoader workers run one thread each), while on a small shared CPU box OpenMP
# threads make (c)'s batch ops swing 5-10x with whatever else runs. ACCELTRAIN_BENCH_THREADS changes it.
TORCH_THREADS = int(os.environ.get("ACCELTRAIN_BENCH_THREADS", "1"))


def images_per_second(batches) -> float:
    """Ready images per second: one warm-up batch, then the best of REPEATS windows of TIMED_BATCHES,
    with the device synchronised before each clock read so that queued GPU work is counted."""
    iterator = iter(batches)
    on_device(next(iterator))
    windows = []
    for _ in range(REPEATS):
        sync()
        started = time.perf_counter()
        for _ in range(TIMED_BATCHES):
            on_device(next(iterator))
        sync()
        windows.append(TIMED_BATCHES * BATCH_SIZE / (time.perf_counter() - started))
    return max(windows)


def on_device(batch):
    return [tensor.to(DEVICE, non_blocking=True) for tensor in batch]


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def best_over_workers(name: str, make_loader) -> dict:
    rates = {workers: images_per_second(make_loader(workers)) for workers in WORKER_CHOICES}
    best = max(rates, key=rates.get)
    return {"loader": name, "num_workers": best, "images_per_second": rates[best], "by_num_workers": rates}


def torchvision_loader(root, workers: int) -> DataLoader:
    from torchvision import datasets, transforms

    from acceltrain.vision import CIFAR10_MEAN, CIFAR10_STD

    transform = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
        ]
    )
    dataset = datasets.ImageFolder(str(root / "train"), transform=transform)
    return DataLoader(
        dataset,
        batch_size=BATCH_SIZE,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        pin_memory=DEVICE.type == "cuda",
        persistent_workers=workers > 0,
    )


def main() -> None:
    from acceltrain.data.loaders import train_loader
    from acceltrain.vision import DeviceImageLoader, image_datasets

    torch.set_num_threads(TORCH_THREADS)
    info = start(f"loader: ready batches of {BATCH_SIZE} on {DEVICE}, {TORCH_THREADS} torch thread(s)")
    root = cifar10_jpeg()
    if root is None:
        return
    torch.manual_seed(0)
    train_set, _ = image_datasets("imagefolder", str(root), seed=0)
    rows = [
        best_over_workers("torchvision ImageFolder + transforms", lambda workers: torchvision_loader(root, workers)),
        best_over_workers(
            "acceltrain DataLoader path",
            lambda workers: train_loader(
                train_set, batch_size=BATCH_SIZE, seed=0, num_workers=workers, pin_memory=DEVICE.type == "cuda"
            ),
        ),
    ]

    for stale in root.glob("decoded-*.safetensors"):  # so that the cold build really decodes
        stale.unlink(missing_ok=True)  # another run sharing the cache may have removed it since the listing
    seconds = {}
    for build in ("cold", "warm"):
        started = time.perf_counter()
        loader = DeviceImageLoader.from_dataset(
            train_set, batch_size=BATCH_SIZE, seed=0, device=DEVICE, process_index=0, num_processes=1, cache_dir=root
        )
        seconds[build] = time.perf_counter() - started
    rows.append(
        {"loader": "acceltrain DeviceImageLoader", "num_workers": 0, "images_per_second": images_per_second(loader)}
    )

    baseline = rows[0]["images_per_second"]
    print(f"{'loader':40} {'workers':>7} {'images/s':>10} {'vs (a)':>8}")
    for row in rows:
        row["vs_torchvision"] = row["images_per_second"] / baseline
        print(
            f"{row['loader']:40} {row['num_workers']:>7} {row['images_per_second']:>10,.0f} "
            f"{row['vs_torchvision']:>7.1f}x"
        )
    print(
        f"device loader one-off: decode + write cache {seconds['cold']:.1f} s (cold), "
        f"read cache {seconds['warm']:.2f} s (warm)"
    )
    ratio = rows[2]["vs_torchvision"]
    print(f"device loader / torchvision = {ratio:.1f}x; {verdict(ratio, TARGET, at_least=True)}")
    write_result(
        "loader",
        info,
        {
            "batch_size": BATCH_SIZE,
            "timed_batches": TIMED_BATCHES,
            "repeats": REPEATS,
            "device": str(DEVICE),
            "results": rows,
            "device_loader_decode_seconds": seconds["cold"],
            "device_loader_cache_read_seconds": seconds["warm"],
            "target_ratio": TARGET,
            "ratio": ratio,
            "target_met": ratio >= TARGET,
        },
    )


if __name__ == "__main__":
    main()

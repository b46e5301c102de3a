"""Comparison (d): the fast path vs a torchvision DataLoader with per-image PIL transforms.

Both deliver the same thing, a normalised float batch (B, 3, H, W) with random crop + flip on
the device, from the same CIFAR-sized uint8 images. Fast: one uint8 tensor, one index op per
batch, augmentation batched on the device (vitpipe.data.fast). PIL: the images as PIL images in
memory and the standard path's per-image torchvision v2 pipeline in ``workers`` processes.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from vitpipe.bench.loops import synthetic_data
from vitpipe.bench.settings import BenchConfig
from vitpipe.bench.timing import StepClock, interleave_runs, summarize

NATIVE_SIZE = 32  # CIFAR


class PILImageDataset(Dataset):
    """In-memory PIL images and int labels behind a per-image transform (no files, no download)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:
        # uint8 (N, C, H, W) -> N PIL images (H, W, C)
        self.images = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images]
        self.labels = labels.tolist()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def _drain(loader, cfg: BenchConfig, to_input) -> list[float]:
    clock = StepClock(warmup=cfg.warmup, device=cfg.device)
    for x, y in loader:
        x, y = to_input(x.to(cfg.device, non_blocking=True)), y.to(cfg.device, non_blocking=True)
        clock.tick()
    return clock.times()


def compare_data(cfg: BenchConfig) -> dict:
    batches = cfg.warmup + cfg.steps
    fast = synthetic_data(cfg, batches=batches, native_size=NATIVE_SIZE)
    fast.setup("fit")
    standard = synthetic_data(cfg, batches=batches, native_size=NATIVE_SIZE, fast_path=False)
    pil = PILImageDataset(fast.data_train.images, fast.data_train.labels, standard.transform(train=True))

    def run_fast() -> list[float]:
        return _drain(fast.train_dataloader(), cfg, lambda x: fast.augment_batch(x, train=True))

    def run_pil() -> list[float]:
        loader = DataLoader(pil, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                            pin_memory=cfg.device == "cuda")
        return _drain(loader, cfg, lambda x: x)

    times = interleave_runs({"fast": run_fast, "pil": run_pil}, repeats=cfg.repeats)
    contenders = {name: {"load": summarize(t, cfg.batch_size)} for name, t in times.items()}
    return {
        "contenders": contenders,
        "ratios": {"throughput fast/pil": contenders["fast"]["load"]["img_s"] / contenders["pil"]["load"]["img_s"]},
        "workers": cfg.workers,
        "native_size": NATIVE_SIZE,
    }

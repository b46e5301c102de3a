"""``--only shards``: data=shards against data=imagefolder reading the same JPEG files."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from vitpipe.benchmark.common import paired_repeat_ratio
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.data import loader_throughput
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.shards import ShardsDataModule
from vitpipe.tasks.make_shards import make_shards


def compare_shards(cfg: BenchConfig, *, native_size: int = 96) -> dict:
    """data=shards vs data=imagefolder over the same JPEG files (random pixels, ``native_size`` px, 2
    classes): both loaders decode and apply the training transforms (RandomResizedCrop, flip) in
    ``workers`` processes; the shards are written once by make_shards (one 64 MB chunk)."""
    n = (cfg.warmup + cfg.steps) * cfg.batch_size
    rng = np.random.default_rng(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="vitpipe-bench-shards-") as tmp:
        for i in range(n):
            folder = Path(tmp, "images", "train", f"c{i % 2}")
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (native_size, native_size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
        common = dict(num_classes=2, channels=3, img_size=cfg.size, in_chans=3, batch_size=cfg.batch_size,
                      num_workers=cfg.workers, pin_memory=cfg.device == "cuda", val_split=0)
        folder_dm = ImageFolderDataModule(root=str(Path(tmp, "images")), **common)
        make_shards(folder_dm, str(Path(tmp, "shards")))
        modules = {"imagefolder": folder_dm, "shards": ShardsDataModule(root=str(Path(tmp, "shards")), **common)}
        for dm in modules.values():
            dm.setup("fit")
        contenders = loader_throughput(cfg, {name: (dm.train_dataloader, lambda x: x) for name, dm in modules.items()})
    shards, folder = contenders["shards"]["load"], contenders["imagefolder"]["load"]
    ratios = {"throughput shards/imagefolder": shards["img_s"] / folder["img_s"],
              "throughput shards/imagefolder (paired repeats)": paired_repeat_ratio(folder["per_repeat_step_s"],
                                                                                     shards["per_repeat_step_s"])}
    return {"contenders": contenders, "ratios": ratios, "workers": cfg.workers, "native_size": native_size}

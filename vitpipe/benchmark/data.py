"""``--only data``: the fast path (uint8 tensor, batched augmentation on the device) against a PIL
DataLoader; ``loader_throughput`` is also the shards comparison's clock."""

from __future__ import annotations

from hydra.utils import instantiate
from PIL import Image
from torch.utils.data import DataLoader

from vitpipe.benchmark.common import StepClock, interleave_runs, summarize
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.recipe import recipe
from vitpipe.data.transforms import TransformedSubset

PIL_NATIVE_SIZE = 32  # the data comparison's images are CIFAR-sized


def loader_throughput(cfg: BenchConfig, loaders: dict) -> dict:
    """Images/s of each ``name -> (make_loader, to_input)``, the loaders taking turns (interleaved)."""

    def drain(name: str) -> list[float]:
        make_loader, to_input = loaders[name]
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        for x, y in make_loader():
            x, y = to_input(x.to(cfg.device, non_blocking=True)), y.to(cfg.device, non_blocking=True)
            clock.tick()
        return clock.times()

    times = interleave_runs({name: lambda name=name: drain(name) for name in loaders}, repeats=cfg.repeats)
    return {name: {"load": summarize(t, cfg.batch_size)} for name, t in times.items()}


def compare_data(cfg: BenchConfig) -> dict:
    """The fast path (one uint8 tensor, crop/flip batched on the device) vs a DataLoader running the
    standard path's per-image torchvision transforms on PIL images in ``workers`` processes."""
    data_cfg = recipe(cfg, batches=cfg.warmup + cfg.steps, native_size=PIL_NATIVE_SIZE).data
    fast, standard = instantiate(data_cfg), instantiate(data_cfg, fast_path=False)
    fast.setup("fit")
    images = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in fast.data_train.images]  # uint8 CHW -> PIL
    pil = TransformedSubset(list(zip(images, fast.data_train.labels.tolist())), None, standard.transform(train=True))
    loaders = {
        "fast": (lambda: fast.train_dataloader(), lambda x: fast.augment_batch(x, train=True)),
        "pil": (lambda: DataLoader(pil, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                                   pin_memory=cfg.device == "cuda"), lambda x: x),
    }
    contenders = loader_throughput(cfg, loaders)
    ratio = contenders["fast"]["load"]["img_s"] / contenders["pil"]["load"]["img_s"]
    return {"contenders": contenders, "ratios": {"throughput fast/pil": ratio}, "workers": cfg.workers,
            "native_size": PIL_NATIVE_SIZE}

"""Comparison (c): a hand-written PyTorch loop vs ``Trainer.fit()`` on the same model and data.

Both train vitpipe's ViT on the fast path's synthetic uint8 data (crop/flip on the device) with
the ImageClassifier recipe of conf/module/classifier.yaml: AdamW, per-step warm-up + cosine (timm),
label smoothing 0.1, gradient clipping at norm 1. The plain loop does Lightning's work in
Lightning's order (zero_grad after the forward, before backward). Lightning runs without logger,
progress bar, checkpointing or validation: the comparison is the training loop itself.
Each run times the gaps between step ends, so data loading and framework hooks count.
"""

from __future__ import annotations

import functools
import logging

import lightning as L
import torch
import torch.nn.functional as F
from timm.scheduler import CosineLRScheduler

from vitpipe.bench.memory import StepMemory
from vitpipe.bench.models import ADAMW, build_vit, grad_scaler, make_optimizer, maybe_compile
from vitpipe.bench.settings import BenchConfig
from vitpipe.bench.timing import StepClock, interleave_runs, summarize
from vitpipe.data import SyntheticDataModule
from vitpipe.lit import ImageClassifier

LABEL_SMOOTHING, CLIP_NORM, WARMUP_FRACTION = 0.1, 1.0, 0.05
SCHEDULER = functools.partial(CosineLRScheduler, lr_min=1e-5, warmup_lr_init=1e-6, t_in_epochs=False)


def synthetic_data(cfg: BenchConfig, *, batches: int, native_size: int | None = None,
                   fast_path: bool = True) -> SyntheticDataModule:
    """Exactly ``batches`` training batches of random uint8 images (no validation split)."""
    return SyntheticDataModule(
        num_classes=cfg.num_classes, channels=3, native_size=native_size or cfg.size, length=batches * cfg.batch_size,
        test_length=cfg.batch_size, img_size=cfg.size, in_chans=3, batch_size=cfg.batch_size, val_split=0,
        seed=cfg.seed, fast_path=fast_path, pin_memory=cfg.device == "cuda", num_workers=0,
    )


class _StepTimer(L.Callback):
    """Per-step clock inside ``fit``; profiles the memory of the step after the timed ones."""

    def __init__(self, clock: StepClock, memory: StepMemory, memory_step: int) -> None:
        self.clock, self.memory, self.memory_step = clock, memory, memory_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.memory_step:
            self.memory.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step <= self.memory_step:  # global_step already counts this step
            self.clock.tick()
        else:
            self.memory.__exit__(None, None, None)


def run_plain(cfg: BenchConfig, dm: SyntheticDataModule, state: dict, result: dict) -> list[float]:
    net = build_vit(cfg)
    net.load_state_dict(state)
    model = maybe_compile(net.train(), cfg)
    optimizer = make_optimizer(net)
    total = cfg.warmup + cfg.steps + 1
    scheduler = SCHEDULER(optimizer, t_initial=total, warmup_t=int(WARMUP_FRACTION * total))
    scaler = grad_scaler(cfg)
    clock, memory = StepClock(warmup=cfg.warmup, device=cfg.device), StepMemory(cfg.device)
    for i, (x, y) in enumerate(dm.train_dataloader()):
        x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
        x = dm.augment_batch(x, train=True)  # Lightning: on_after_batch_transfer
        if i == total - 1:  # after the batch reached the device, as Lightning's on_train_batch_start
            memory.__enter__()
        with cfg.autocast():
            loss = F.cross_entropy(model(x), y, label_smoothing=LABEL_SMOOTHING)
        optimizer.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP_NORM)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP_NORM)
            scaler.step(optimizer)
            scaler.update()
        scheduler.step_update(num_updates=i + 1)
        if i == total - 1:
            memory.__exit__(None, None, None)
            break
        clock.tick()
    result["memory"] = memory.as_dict()
    return clock.times()


def run_lightning(cfg: BenchConfig, dm: SyntheticDataModule, state: dict, result: dict) -> list[float]:
    net = build_vit(cfg)
    net.load_state_dict(state)
    module = ImageClassifier(net, optimizer=ADAMW, scheduler=SCHEDULER, warmup_fraction=WARMUP_FRACTION,
                             label_smoothing=LABEL_SMOOTHING, compile=cfg.compile)
    total = cfg.warmup + cfg.steps + 1
    clock, memory = StepClock(warmup=cfg.warmup, device=cfg.device), StepMemory(cfg.device)
    trainer = L.Trainer(
        accelerator=cfg.lightning_accelerator, devices=1, precision=cfg.precision, max_steps=total,
        gradient_clip_val=CLIP_NORM, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[_StepTimer(clock, memory, memory_step=total - 1)],
    )
    trainer.fit(module, datamodule=dm)
    result["memory"] = memory.as_dict()
    return clock.times()


def compare_loops(cfg: BenchConfig) -> dict:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-fit banner
    dm = synthetic_data(cfg, batches=cfg.warmup + cfg.steps + 1)
    dm.setup("fit")
    state = {k: v.detach().clone() for k, v in build_vit(cfg).state_dict().items()}  # every run starts here
    extra = {"plain": {}, "lightning": {}}
    runs = {
        "plain": lambda: run_plain(cfg, dm, state, extra["plain"]),
        "lightning": lambda: run_lightning(cfg, dm, state, extra["lightning"]),
    }
    times = interleave_runs(runs, repeats=cfg.repeats)
    contenders = {name: {"train": {**summarize(times[name], cfg.batch_size), **extra[name]}} for name in runs}
    return {
        "contenders": contenders,
        "ratios": {"step_time lightning/plain": contenders["lightning"]["train"]["step_s"]
                   / contenders["plain"]["train"]["step_s"]},
    }

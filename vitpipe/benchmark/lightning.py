"""``--only lightning``: ``Trainer.fit`` against a hand-written loop doing the same work, on the recipe."""

from __future__ import annotations

import copy
import logging

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from vitpipe.benchmark.common import StepClock, compiled, interleave_runs, summarize
from vitpipe.benchmark.config import BenchConfig
from vitpipe.benchmark.recipe import optimizer, recipe
from vitpipe.config.build import build_trainer
from vitpipe.run.build import build_from_config


class _StepClockCallback(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_end(self, *args) -> None:
        self.clock.tick()


def compare_lightning(cfg: BenchConfig) -> dict:
    """``Trainer.fit`` vs a hand-written loop doing Lightning's work in Lightning's order (zero_grad
    after the forward), on the recipe's model, optimizer, schedule, loss, clipping and fast-path data.
    Lightning runs without logger, progress bar, checkpoints or validation; gaps between step ends
    are timed, so data loading and framework hooks count."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-fit banner
    total = cfg.warmup + cfg.steps
    train_cfg = recipe(cfg, batches=total)
    torch.manual_seed(cfg.seed)
    dm, net0, _ = build_from_config(train_cfg)
    dm.setup("fit")

    def fresh_module():  # every run starts from the same weights, with its own compile and optimizer state
        return instantiate(train_cfg.module, net=copy.deepcopy(net0))

    def plain() -> list[float]:
        module = fresh_module()
        net = module.net
        model, opt = compiled(net.train(), cfg), optimizer(train_cfg, net)
        sched = module.scheduler_factory(opt, t_initial=total, warmup_t=int(module.hparams.warmup_fraction * total))
        scaler = torch.amp.GradScaler(cfg.device, enabled=cfg.precision == "16-mixed")
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        for i, (x, y) in enumerate(dm.train_dataloader()):
            x, y = x.to(cfg.device, non_blocking=True), y.to(cfg.device, non_blocking=True)
            x = dm.augment_batch(x, train=True)  # Lightning: on_after_batch_transfer
            with cfg.autocast():
                loss = F.cross_entropy(model(x), y, label_smoothing=module.hparams.label_smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), train_cfg.trainer.gradient_clip_val)
            scaler.step(opt)
            scaler.update()
            sched.step_update(num_updates=i + 1)
            clock.tick()
        return clock.times()

    def lightning() -> list[float]:
        clock = StepClock(warmup=cfg.warmup, device=cfg.device)
        trainer = build_trainer(train_cfg.trainer, max_steps=total, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False,
                              callbacks=[_StepClockCallback(clock)])
        trainer.fit(fresh_module(), datamodule=dm)
        return clock.times()

    times = interleave_runs({"plain": plain, "lightning": lightning}, repeats=cfg.repeats)
    contenders = {n: {"train": summarize(t, cfg.batch_size)} for n, t in times.items()}
    ratio = contenders["lightning"]["train"]["step_s"] / contenders["plain"]["train"]["step_s"]
    return {"contenders": contenders, "ratios": {"step_time lightning/plain": ratio}}

"""Optimizer parameter groups and step-based schedules."""

from __future__ import annotations

import torch
from torch import nn


def param_groups(net: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decay for weight matrices; none for norms, biases and what the model names
    in ``no_weight_decay()`` (positions, class/register tokens), after timm and nanoGPT."""
    skip = set(net.no_weight_decay()) if hasattr(net, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(partial_optimizer, net: nn.Module) -> torch.optim.Optimizer:
    """Call a Hydra partial optimizer on the two groups; fused AdamW on CUDA where torch has it."""
    wd = partial_optimizer.keywords.get("weight_decay", 0.0) if hasattr(partial_optimizer, "keywords") else 0.0
    kwargs = {}
    func = getattr(partial_optimizer, "func", partial_optimizer)
    on_cuda = next(net.parameters()).is_cuda
    if func in (torch.optim.AdamW, torch.optim.Adam) and on_cuda and "fused" not in partial_optimizer.keywords:
        kwargs["fused"] = True
    return partial_optimizer(param_groups(net, wd), **kwargs)


class ConfiguredOptimizers:
    """LightningModule mixin: ``configure_optimizers`` from the config's partial optimizer and
    scheduler (``self.optimizer_factory``, ``self.scheduler_factory``, ``hparams.warmup_fraction``).

    The scheduler is a timm scheduler called with ``t_initial`` and ``warmup_t`` in optimizer steps,
    stepped per update; timm schedulers are driven by the update count, not torch's ``step()``.
    """

    def configure_optimizers(self):
        optimizer = build_optimizer(self.optimizer_factory, self.net)
        if self.scheduler_factory is None:
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(self.hparams.warmup_fraction * total)
        scheduler = self.scheduler_factory(optimizer, t_initial=total, warmup_t=warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step_update(num_updates=self.global_step)

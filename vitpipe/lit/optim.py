"""Optimizer parameter groups (weight-decay exclusions, layer-wise lr decay) and step-based schedules."""

from __future__ import annotations

import torch
from torch import nn

from vitpipe.lit.time_budget import RESOLUTION, budget_of


def param_groups(net: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """Parameter groups for ``net``'s trainable parameters.

    Without ``layer_decay``: two groups, decay for weight matrices and none for norms, biases and
    what the model names in ``no_weight_decay()`` (positions, class/register tokens), after timm
    and nanoGPT. With it: timm's ``param_groups_layer_decay`` (BEiT, Bao et al. 2022; MAE, He et al.
    2022), the same exclusions per layer, each group carrying ``lr_scale = layer_decay **
    (num_layers - 1 - layer)`` over the layers of ``net.group_matcher()`` (for vitpipe's ViT:
    block i gets decay^(depth - i), the stem decay^(depth + 1), final norm and head 1).
    """
    skip = set(net.no_weight_decay()) if hasattr(net, "no_weight_decay") else set()
    if layer_decay is not None:
        check_layer_decay(layer_decay, net)
        from timm.optim import param_groups_layer_decay

        return param_groups_layer_decay(net, weight_decay=weight_decay, no_weight_decay_list=sorted(skip),
                                        layer_decay=float(layer_decay))
    decay, no_decay = [], []
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def check_layer_decay(layer_decay, net: nn.Module) -> None:
    if layer_decay is None:
        return
    if not (isinstance(layer_decay, (int, float)) and not isinstance(layer_decay, bool) and 0 < layer_decay <= 1):
        raise ValueError(f"module.layer_decay={layer_decay!r}: expected a number in (0, 1], or null for none")
    if not hasattr(net, "group_matcher"):
        raise ValueError(f"module.layer_decay needs a network with group_matcher(); {type(net).__name__} has none")


def build_optimizer(partial_optimizer, net: nn.Module, layer_decay: float | None = None) -> torch.optim.Optimizer:
    """Call a Hydra partial optimizer on the parameter groups; fused AdamW on CUDA where torch has it."""
    wd = partial_optimizer.keywords.get("weight_decay", 0.0) if hasattr(partial_optimizer, "keywords") else 0.0
    kwargs = {}
    func = getattr(partial_optimizer, "func", partial_optimizer)
    on_cuda = next(net.parameters()).is_cuda
    if func in (torch.optim.AdamW, torch.optim.Adam) and on_cuda and "fused" not in partial_optimizer.keywords:
        kwargs["fused"] = True
    return partial_optimizer(param_groups(net, wd, layer_decay), **kwargs)


def is_timm_scheduler(factory) -> bool:
    """Whether a (partial) scheduler is one of timm's, which apply each group's ``lr_scale`` themselves."""
    from timm.scheduler.scheduler import Scheduler

    func = getattr(factory, "func", factory)
    return isinstance(func, type) and issubclass(func, Scheduler)


def fold_lr_scale(optimizer: torch.optim.Optimizer) -> None:
    """Multiply each group's lr by its ``lr_scale``, once. For no scheduler and torch schedulers
    (which record the lr they find as ``initial_lr``): only timm's schedulers read ``lr_scale``, and
    they multiply on every update, so folding it in under them would apply it twice."""
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * group.get("lr_scale", 1.0)


class ConfiguredOptimizers:
    """LightningModule mixin: ``configure_optimizers`` from the config's partial optimizer and
    scheduler (``self.optimizer_factory``, ``self.scheduler_factory``, ``hparams.warmup_fraction``,
    optional ``hparams.layer_decay``).

    A timm scheduler is called with ``t_initial`` and ``warmup_t`` in optimizer steps and stepped per
    update (timm schedulers are driven by the update count, not torch's ``step()``); a torch
    ``LRScheduler`` is called with the optimizer alone (its own arguments come from the config, in
    optimizer steps) and stepped once per optimizer step. Under ``trainer.time_budget`` the timm
    scheduler runs over the budget's progress instead of a step count (``vitpipe.lit.time_budget``):
    ``t_initial`` is its resolution and each update is stepped at ``position(global_step)``.
    """

    def configure_optimizers(self):
        optimizer = build_optimizer(self.optimizer_factory, self.net, self.hparams.get("layer_decay"))
        factory = self.scheduler_factory
        timm_schedule = factory is not None and is_timm_scheduler(factory)
        if not timm_schedule:
            fold_lr_scale(optimizer)
        if factory is None:
            return optimizer
        budget = budget_of(self.trainer)
        if budget is not None and not timm_schedule:
            raise ValueError(f"trainer.time_budget fits a timm scheduler to the time; module.scheduler "
                             f"{getattr(factory, 'func', factory).__name__} is sized by its own arguments "
                             "(use timm.scheduler.CosineLRScheduler or PolyLRScheduler, or module.scheduler=null)")
        if timm_schedule:
            total = RESOLUTION if budget is not None else max(1, int(self.trainer.estimated_stepping_batches))
            warmup = int(self.hparams.warmup_fraction * total)
            scheduler = factory(optimizer, t_initial=total, warmup_t=warmup)
        else:
            scheduler = factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if hasattr(scheduler, "step_update"):  # timm
            budget = budget_of(self.trainer)
            scheduler.step_update(num_updates=budget.position(self.global_step) if budget else self.global_step)
        else:
            scheduler.step()

"""Fine-tuning modes: which part of a pretrained network trains, and when.

``module.finetune``:

- ``full``: everything trains (with ``module.layer_decay``, BEiT/MAE-style lower rates for lower blocks).
- ``linear_probe``: only the head (``net.get_classifier()``) trains; the encoder is frozen for the
  whole run (MAE's linear probing; He et al. 2022): ``requires_grad=False``, so it is in no
  optimizer group (no gradient, no weight decay, no momentum), and kept in eval mode (no dropout,
  no stochastic depth, BatchNorm in a conv stem uses its running statistics).
- ``head_then_full``: the head alone for ``module.finetune_warmup_epochs`` epochs, then everything
  (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained Features": LP-FT).
- ``lora``: low-rank adapters (``module.lora``: r, alpha, dropout, targets) on the encoder's linear layers,
  the head in full, everything else frozen from the module's construction on (Hu et al. 2021;
  ``vitpipe.models.lora``, through Hugging Face peft). Needs ``model.pretrained`` (refused without: adapters
  on a frozen random network learn next to nothing). Every command that reads the run back merges the
  adapters into plain weights.

``module.probe_bn=true`` puts MAE's linear-probe BatchNorm (He et al. 2022, Appendix A.2: BatchNorm1d
without affine, eps 1e-6, on the pooled features) in front of the head: ``ProbeHead``, an ``nn.Linear``
that owns the BN, replaces ``net.head``. The head's keys stay ``head.weight``/``head.bias`` (plus
``head.bn.running_mean``/``running_var``/``num_batches_tracked``), the BN trains with the head (it is
part of ``get_classifier()``), and a checkpoint rebuilds it from its stored module config. In eval
mode the BN is an affine map, so ``ProbeHead.folded()`` absorbs it into a plain ``nn.Linear`` (the
paper: "can be absorbed into the linear classifier after training"): the timm export writes that one.

Every parameter group is built at the start, encoder included, so the schedule, its warm-up and the
layer decay cover the encoder from step 0. During the head-only epochs the encoder keeps
``requires_grad=True`` (DDP registers its gradient all-reduce for exactly the parameters that
require grad when it wraps the model: flipping it later would leave the encoder unsynchronised) and
its gradients are cleared before every optimizer step. A cleared gradient (``None``) leaves AdamW's
and SGD's weights, moments and step counts alone; a zero gradient would not (decoupled weight decay
and momentum still move the weights). Lightning's ``BackboneFinetuning`` instead adds the encoder's
group to the optimizer when it unfreezes, and timm's schedulers never schedule a group added later.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

FINETUNE_MODES = ("full", "linear_probe", "head_then_full", "lora")


def check_finetune(mode: str, warmup_epochs: int) -> None:
    if mode not in FINETUNE_MODES:
        raise ValueError(f"module.finetune={mode!r}; valid choices: {', '.join(FINETUNE_MODES)}")
    if not isinstance(warmup_epochs, int) or isinstance(warmup_epochs, bool) or warmup_epochs < 0:
        raise ValueError(f"module.finetune_warmup_epochs={warmup_epochs!r}: expected an int >= 0")
    if mode == "head_then_full" and warmup_epochs == 0:
        raise ValueError("module.finetune=head_then_full needs module.finetune_warmup_epochs >= 1 "
                         "(the head-only epochs); with 0 use module.finetune=full")


class ProbeHead(nn.Linear):
    """``linear(bn(x))``: MAE's linear-probe head, BatchNorm1d(affine=False, eps=1e-6) then ``linear``'s weights."""

    def __init__(self, linear: nn.Linear) -> None:
        w = linear.weight
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.weight.copy_(w)
            if linear.bias is not None:
                self.bias.copy_(linear.bias)
        self.bn = nn.BatchNorm1d(linear.in_features, affine=False, eps=1e-6, device=w.device, dtype=w.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.bn(x))

    @torch.no_grad()
    def folded(self) -> nn.Linear:
        """The eval-mode head as one ``nn.Linear``: W / sqrt(var + eps), b - (W / sqrt(var + eps)) @ mean."""
        scale = (self.bn.running_var + self.bn.eps).rsqrt()
        out = nn.Linear(self.in_features, self.out_features, device=self.weight.device, dtype=self.weight.dtype)
        out.weight.copy_(self.weight * scale)
        out.bias.copy_((self.bias if self.bias is not None else 0) - out.weight @ self.bn.running_mean)
        return out


def add_probe_bn(net: nn.Module) -> None:
    """Replace ``net.head`` (an ``nn.Linear``) by a ``ProbeHead`` with its weights; ValueError otherwise."""
    head = getattr(net, "head", None)
    if type(head) is not nn.Linear or getattr(net, "head_dist", None) is not None:
        raise ValueError(f"module.probe_bn=true needs a network whose head is one nn.Linear (net.head); "
                         f"{type(net).__name__} has {type(head).__name__}"
                         + (" and a distillation head" if getattr(net, "head_dist", None) is not None else ""))
    net.head = ProbeHead(head)


def fold_probe_bn(net: nn.Module) -> nn.Module:
    """``net`` itself when its head is no ``ProbeHead``, else a copy whose head is ``ProbeHead.folded()``."""
    if not isinstance(getattr(net, "head", None), ProbeHead):
        return net
    import copy

    out = copy.deepcopy(net)
    out.head = net.head.folded()
    return out.train(net.training)


def head_and_encoder(net: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
    """(the head module, the encoder's parameters: every parameter of ``net`` outside the head)."""
    if not hasattr(net, "get_classifier"):
        raise ValueError(f"module.finetune needs a network with get_classifier(); {type(net).__name__} has none")
    head = net.get_classifier()
    in_head = {id(p) for p in head.parameters()}
    return head, [p for p in net.parameters() if id(p) not in in_head]


class FineTuning(L.Callback):
    """Freezes the encoder of ``pl_module.net`` per ``mode`` (see the module docstring)."""

    def __init__(self, mode: str, warmup_epochs: int = 0) -> None:
        check_finetune(mode, warmup_epochs)
        self.mode, self.warmup_epochs = mode, warmup_epochs

    def encoder_frozen(self, epoch: int) -> bool:
        return self.mode == "linear_probe" or (self.mode == "head_then_full" and epoch < self.warmup_epochs)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # before DDP wraps the model and before configure_optimizers builds the groups
        if stage == "fit" and self.mode == "linear_probe":
            for p in head_and_encoder(pl_module.net)[1]:
                p.requires_grad_(False)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's evaluation loops restore these modes afterwards, so they hold for the epoch
        frozen = self.encoder_frozen(trainer.current_epoch)
        net = pl_module.net
        net.train(not frozen)
        net.get_classifier().train(True)
        if self.mode == "head_then_full" and trainer.current_epoch == self.warmup_epochs and trainer.is_global_zero:
            print(f"vitpipe: epoch {self.warmup_epochs}: encoder unfrozen (module.finetune=head_then_full)")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # before gradient clipping, so the clipping norm is the head's alone while the encoder waits
        if self.mode == "head_then_full" and self.encoder_frozen(trainer.current_epoch):
            for p in head_and_encoder(pl_module.net)[1]:
                p.grad = None

"""Multi-label losses and mixing: targets are multi-hot float tensors (B, C), one sigmoid per class.

- ``bce``: binary cross-entropy with logits, label smoothing as timm's ``BinaryCrossEntropy`` does
  it for dense targets (``smooth_dense=True``: each target moved towards 0.5, ``t (1 - s) + s / 2``).
- ``asl``: the asymmetric loss of Ridnik et al. 2021 ("Asymmetric Loss For Multi-Label
  Classification"), eq. 1-4: focusing ``gamma_pos`` on positives, ``gamma_neg`` on negatives and the
  probability margin ``clip`` (``p_m = max(p - clip, 0)``) that discards easy negatives.

Mixup/CutMix of multi-hot targets is timm's own (``Mixup(multi_label=True)``: the targets mixed by
the images' lambda after the same smoothing), so a mixed batch reaches the loss already smoothed.

Both average over the B x C entries (the paper sums; the mean keeps a learning rate tuned for BCE
usable) and take ``pos_weight`` (C,): the weight of each class's positive term (torch's BCE convention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vitpipe.errors import ConfigError

LOSSES = ("bce", "asl")
ASL_DEFAULTS = {"gamma_neg": 4.0, "gamma_pos": 0.0, "clip": 0.05}  # the paper's defaults (sec. 4)


def check_loss(loss: str, asl: dict | None) -> dict:
    """The ASL settings (gamma_neg, gamma_pos, clip) for ``loss``; ConfigError naming a bad value."""
    if loss not in LOSSES:
        raise ConfigError(f"module.loss={loss!r}; valid choices: {', '.join(LOSSES)} (multi-label: module.task=multilabel)")
    out = dict(ASL_DEFAULTS)
    for key, value in dict(asl or {}).items():
        if key not in out:
            raise ConfigError(f"module.asl.{key} is not a setting; valid: {', '.join(out)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f"module.asl.{key}={value!r}: expected a number >= 0")
        out[key] = float(value)
    if out["clip"] >= 1:
        raise ConfigError(f"module.asl.clip={out['clip']}: the probability margin must be in [0, 1)")
    return out


def smooth_multilabel(target: Tensor, smoothing: float) -> Tensor:
    """timm's dense-target smoothing: every binary target moved towards 0.5 by ``smoothing``."""
    return target * (1.0 - smoothing) + 0.5 * smoothing if smoothing else target


def bce_loss(logits: Tensor, target: Tensor, *, smoothing: float = 0.0, pos_weight: Tensor | None = None) -> Tensor:
    """Mean BCE with logits over (B, C); ``target`` multi-hot (or mixed) floats (B, C)."""
    return F.binary_cross_entropy_with_logits(logits, smooth_multilabel(target, smoothing), pos_weight=pos_weight)


def asl_loss(logits: Tensor, target: Tensor, *, gamma_neg: float = 4.0, gamma_pos: float = 0.0, clip: float = 0.05,
             smoothing: float = 0.0, pos_weight: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """Asymmetric loss, mean over (B, C). Per entry, with p = sigmoid(logit) and p_m = max(p - clip, 0):
    ``-(y (1 - p)^gamma_pos log p + (1 - y) p_m^gamma_neg log(1 - p_m))``; soft targets weight the two terms."""
    target = smooth_multilabel(target, smoothing)
    p = torch.sigmoid(logits)
    p_m = (p - clip).clamp(min=0) if clip else p
    pos = (1 - p).pow(gamma_pos) * torch.log(p.clamp(min=eps))  # (B, C)
    neg = p_m.pow(gamma_neg) * torch.log((1 - p_m).clamp(min=eps))
    if pos_weight is not None:
        pos = pos * pos_weight
    return -(target * pos + (1 - target) * neg).mean()


def multilabel_loss(logits: Tensor, target: Tensor, *, loss: str = "bce", asl: dict | None = None,
                    smoothing: float = 0.0, pos_weight: Tensor | None = None) -> Tensor:
    """``bce`` or ``asl`` (with ``asl``'s gamma_neg, gamma_pos, clip) of logits (B, C) against targets (B, C)."""
    if loss == "asl":
        return asl_loss(logits, target, smoothing=smoothing, pos_weight=pos_weight, **(asl or ASL_DEFAULTS))
    return bce_loss(logits, target, smoothing=smoothing, pos_weight=pos_weight)

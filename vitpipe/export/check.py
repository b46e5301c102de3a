"""The check every exporter runs before it publishes: the exported model's logits against the network's
(timm's ``onnx_validate.py`` idea), so a file that answers differently is never written under its name."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.errors import ExportCheckError


@torch.no_grad()
def check_logits(got: Tensor, net: nn.Module, x: Tensor, *, tolerance: float, differs: str,
                 measure: str = "max abs difference", then: str = "") -> float:
    """Max abs difference of ``got`` (the exported model's logits on ``x``) from ``net(x)``.

    Above ``tolerance`` (or NaN) raises ExportCheckError ``"<differs>: <measure> <diff> > <tolerance><then>"``.
    """
    diff = (got - net.eval()(x)).abs().max().item()
    if not diff <= tolerance:  # written so a NaN difference fails too
        raise ExportCheckError(f"{differs}: {measure} {diff:.3g} > {tolerance}{then}")
    return diff

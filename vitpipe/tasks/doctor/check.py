"""One check's result and its line in the doctor's report; what "equal" means for the probes.

The probes run in float64, so "unchanged" means equal to round-off (``TOL``): any real effect, even that
of a freshly initialised position table or relative bias (~1e-5 of the output), is far above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from vitpipe.models.captioner import Captioner
from vitpipe.models.vit import ViT

TOL = 1e-10  # relative difference that counts as "equal" in float64 (round-off is ~1e-15)
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str  # PASS | FAIL | SKIP
    value: float | None  # the number measured; None when skipped
    measured: str  # what was measured, with the number, in words (SKIP: why the check does not apply)
    problem: str = ""  # FAIL: what is wrong and where to look

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def line(self) -> str:
        text = f"{self.name:<9} {self.status}  {self.measured}"
        return f"{text}. {self.problem}" if self.problem else text


def rel(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b|: 0 for equal tensors; inf when the shapes differ."""
    if a.shape != b.shape:
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def encoder_of(net: nn.Module) -> ViT:
    """The image encoder: the ViT itself, or a captioner's."""
    return net.encoder if isinstance(net, Captioner) else net

"""Logits -> TTA -> temperature -> probabilities: the one composition eval and inference share.

``tta=hflip`` averages the softmax of an image and its mirror; the temperature (Guo et al. 2017)
then divides the log of that average. This is the order in which eval fits the temperature
(``fit_temperature`` on the validation split's TTA-averaged logits), so it is the only order in
which a fitted temperature means what it was fitted for; inference (``vitpipe.inference.probs``: predict,
serve, demo) and eval's test with the fitted temperature (``at_test_time``) both go through ``tta_logits``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from vitpipe.config.options import TTAS  # the values tta= takes, where the one config check reads them

__all__ = ["TTAS", "at_test_time", "tta_logits"]


def tta_logits(logits: Tensor, mirrored: Callable[[], Tensor] | None = None, *, tta: str = "none",
                     temperature: float | None = None) -> Tensor:
    """Logits (B, C) after TTA and the temperature; their softmax is the prediction.

    logits: the network on the images x (B, C, H, W); mirrored: returns the network on
    ``x.flip(-1)`` (called only for ``tta="hflip"``). With hflip the result is the log of the averaged
    probabilities (softmax(log p) = p), so losses, accuracy and ECE all see the averaged prediction.
    """
    if tta not in TTAS:
        raise ValueError(f"tta={tta!r}; valid choices: {', '.join(TTAS)}")
    if tta == "hflip":
        if mirrored is None:
            raise ValueError("tta=hflip needs the logits of the mirrored images")
        probs = (logits.float().softmax(-1) + mirrored().float().softmax(-1)) / 2  # (B, C)
        logits = probs.clamp_min(torch.finfo(probs.dtype).tiny).log()
    if temperature is not None:
        logits = logits.float() / temperature
    return logits


@contextlib.contextmanager
def at_test_time(net: nn.Module, *, tta: str = "none", temperature: float | None = None):
    """While inside: ``net(x)`` returns ``tta_logits`` (B, C); the hook is removed afterwards."""
    if tta == "none" and temperature is None:
        yield net
        return

    def hook(mod, args, logits):
        # mod.forward, not mod(...): this hook is not re-entered for the mirror
        return tta_logits(logits, lambda: mod.forward(args[0].flip(-1)), tta=tta, temperature=temperature)

    handle = net.register_forward_hook(hook)
    try:
        yield net
    finally:
        handle.remove()

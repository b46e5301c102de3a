"""Module mode for one call: eval mode, then each submodule's own ``training`` flag back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the call, then every submodule's own flag restored (a frozen part stays frozen:
    not one model-wide flag)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode

"""trainer.precision=${auto_precision:}: 32-true on CPU, bf16-mixed from compute capability 8.0
(Ampere), 16-mixed with loss scaling before it (Volta 7.0, Turing 7.5)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from vitpipe.config.build import auto_precision


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), "16-mixed"),    # V100
    ((7, 5), "16-mixed"),    # T4, RTX 20xx
    ((8, 0), "bf16-mixed"),  # A100
    ((9, 0), "bf16-mixed"),  # H100
])
def test_auto_precision_follows_the_compute_capability(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # what torch answers on a V100 or T4 with its default including_emulation=True: bf16 "supported"
    # (emulated, several times slower than fp16 there)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_precision() == expected
    assert OmegaConf.create({"p": "${auto_precision:}"}).p == expected  # what conf/trainer/*.yaml resolve


def test_auto_precision_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_precision() == "32-true"

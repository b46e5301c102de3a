"""What explicit attention costs in memory: the (B, heads, N, M) matrix that fused kernels never build.

Rollout, gradient rollout, ``need_weights`` and ``need_logits`` take the explicit path, which holds one
such matrix per layer (rollout keeps all ``depth`` of them). ``attention_matrix_bytes`` is the estimate
a check prints before such a run; ``format_bytes`` writes it for people. ``check_explicit_attention`` is
that check: one line with the estimate and what to change when it does not fit ``available_memory``.
"""

from __future__ import annotations

import math
import os

import torch


def attention_matrix_bytes(batch: int, heads: int, n_query: int, n_key: int | None = None, *,
                           element_size: int = 4, layers: int = 1) -> int:
    """Bytes of ``layers`` attention matrices (batch, heads, n_query, n_key) of ``element_size``-byte floats."""
    n_key = n_query if n_key is None else n_key
    return int(batch) * int(heads) * int(n_query) * int(n_key) * int(element_size) * int(layers)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def available_memory(device=None) -> int:
    """Bytes free where the matrices would live: ``torch.cuda.mem_get_info`` on a GPU; on a CPU the
    machine's available RAM (``psutil.virtual_memory().available``, else the free physical pages)."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        import psutil
    except ImportError:  # not a dependency: the kernel's own estimate, else free pages (errs low: no cache)
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            return int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return psutil.virtual_memory().available


def check_explicit_attention(batch: int, heads: int, tokens: int, layers: int, *, element_size: int = 4,
                             available_bytes: int | None = None, what: str = "rollout") -> str | None:
    """One line when ``layers`` attention matrices (batch, heads, tokens, tokens) of ``element_size``-byte
    floats (one per layer; more where gradients are kept too) exceed ``available_bytes`` (default: the CPU's
    ``available_memory()``), naming the estimate and what to change (a batch that fits, the tokens that fit,
    a fused method); None when they fit."""
    need = attention_matrix_bytes(batch, heads, tokens, element_size=element_size, layers=layers)
    free = available_memory() if available_bytes is None else int(available_bytes)
    if need <= free:
        return None
    per_image = need // max(int(batch), 1)
    fits = free // per_image if per_image else 0
    smaller = f"batch_size={fits} fits" if fits >= 1 else f"not even batch_size=1: it alone needs {format_bytes(per_image)}"
    n_fit = math.isqrt(max(free, 0) // max(int(heads) * int(element_size) * int(layers), 1))  # at batch 1
    return (f"{what} would hold {format_bytes(need)} of attention matrices ({batch} x {heads} heads x {tokens}^2 tokens "
            f"x {element_size} B x {layers} matrices) but {format_bytes(free)} is available; use a smaller batch "
            f"({smaller}), fewer tokens (a bigger patch_size or a smaller img_size: about {n_fit} tokens fit at "
            f"batch_size=1), or a fused method (SDPA or flex attention build no weights)")

"""What explicit attention costs in memory: the (B, heads, N, M) matrix that fused kernels never build.

Rollout, gradient rollout, ``need_weights`` and ``need_logits`` take the explicit path, which holds one
such matrix per layer (rollout keeps all ``depth`` of them). ``attention_matrix_bytes`` is the estimate
a check prints before such a run; ``format_bytes`` writes it for people.
"""

from __future__ import annotations


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

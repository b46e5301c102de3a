"""T5's relative position bias for text: a learned per-head bias on the attention logits, indexed by the
bucketed offset of key and query (Raffel et al. 2020, T5 section 2.1; Shaw et al. 2018 before it).

The offset ``key - query`` falls into one of ``num_buckets`` buckets: the first half exact for small
distances, the rest logarithmically wider up to ``max_distance``, beyond which every distance shares the
last bucket, so the table never runs out at lengths unseen in training. Bidirectional (encoder) buckets
first split by the sign of the offset; unidirectional (causal decoder) buckets only tell apart keys before
the query. One table serves every layer: T5 computes the bias in the first layer and hands it on.

``relative_position_bucket`` equals Hugging Face's ``T5Attention._relative_position_bucket`` and
``T5RelativeBias`` its ``compute_bias`` (tests/test_t5_bias.py compares both).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

REL_POS_TEXT_KINDS = ("none", "t5")


def exact_buckets(num_buckets: int, bidirectional: bool) -> int:
    """Buckets that hold one distance each (half of those per direction)."""
    return (num_buckets // 2 if bidirectional else num_buckets) // 2


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Integer offsets ``key - query`` (any shape) -> long buckets in [0, num_buckets), same shape.

    Needs ``exact_buckets(num_buckets, bidirectional) >= 1`` and ``max_distance`` above it (the log bins
    span max_exact .. max_distance); ``T5RelativeBias`` checks both.
    """
    relative_position = relative_position.long()
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).long() * num_buckets  # keys after the query: the upper half
        distance = relative_position.abs()
    else:  # keys after the query share bucket 0 with the query itself (causality masks them anyway)
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # the other half: log-spaced bins from max_exact up to max_distance (Mesh TensorFlow's float32 formula,
    # term for term, so the truncation lands where T5's does); clamp: log(0) where the exact bucket wins anyway
    scaled = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    large = (max_exact + scaled.long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(nn.Module):
    """A learned (num_buckets, heads) table; ``forward`` gives bias[h, i, j] = table[bucket(j - i), h].

    The table is named as in Hugging Face's ``T5Attention`` (``relative_attention_bias``), so T5 weights
    copy one to one.
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = False) -> None:
        super().__init__()
        max_exact = exact_buckets(num_buckets, bidirectional)
        if max_exact < 1:
            raise ValueError(f"num_buckets={num_buckets} leaves no exact bucket; expected >= {4 if bidirectional else 2}")
        if max_distance <= max_exact:
            raise ValueError(
                f"max_distance={max_distance} must exceed the {max_exact} exact buckets of num_buckets={num_buckets}"
            )
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        nn.init.trunc_normal_(self.relative_attention_bias.weight, std=0.02)

    def forward(self, query_length: int, key_length: int, past: int = 0) -> Tensor:
        """(1, heads, query_length, key_length): queries at positions past .. past + query_length - 1 (a KV
        cache holds the first ``past``), keys at 0 .. key_length - 1."""
        device = self.relative_attention_bias.weight.device
        query = torch.arange(past, past + query_length, device=device)[:, None]
        key = torch.arange(key_length, device=device)[None, :]
        buckets = relative_position_bucket(
            key - query, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )  # (N, M)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, heads, N, M)

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, bidirectional={self.bidirectional}"

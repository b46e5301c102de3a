"""Token Merging (Bolya et al. 2023, "Token Merging: Your ViT but Faster", ICLR): fewer tokens at inference.

Between the attention and the MLP of every block, ``r`` tokens are merged away by bipartite soft matching
(the paper's section 3): the tokens are split alternately into sets A and B, each A token is joined to
its most similar B token (cosine similarity of the block's attention keys, averaged over heads: the keys
already summarise what a token contains), and the ``r`` most similar of those edges are merged, each
pair into the size-weighted average of its tokens. No training, no parameters; the cost is one (N/2, N/2)
similarity matrix per block.

Every token carries its size, the number of input tokens it holds. Proportional attention adds
``log(size)`` to each key's logit, so a merged token draws the attention its parts would have drawn
together: if token j duplicates token i, merging them and adding ``log 2`` leaves every query's output
unchanged (exp(s) + exp(s) = exp(s + log 2)). ``source`` (optional) records which input tokens each
token holds, a 0/1 (B, tokens, inputs) map whose columns each hold exactly one 1.

Prefix tokens (class, distillation, registers) sit outside the matching: they are never merged away
and nothing is merged into them. The token order after a merge is prefix, kept A tokens, B tokens;
absolute positions were added before the first block, so the order carries no meaning (positional
schemes that need it, rope and relative biases, are refused by the ViT).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Matching:
    """One block's merge: ``src`` A tokens go into the ``dst`` B tokens; ``keep`` A tokens stay.
    Indices are positions within A and B (the patch tokens after the prefix, even and odd), each (B, k)."""

    num_prefix: int
    keep: Tensor  # (B, n_a - r)
    src: Tensor  # (B, r)
    dst: Tensor  # (B, r)

    @property
    def r(self) -> int:
        return self.src.shape[1]


def max_merge(num_tokens: int, num_prefix: int = 0) -> int:
    """The most tokens one block can merge away: half of the tokens after the prefix (set A's size,
    leaving set B one token at least), as the reference bounds ``r``."""
    return max(num_tokens - num_prefix, 0) // 2


def bipartite_soft_matching(metric: Tensor, r: int, num_prefix: int = 0) -> Matching | None:
    """The ``r`` most similar (A, B) pairs of ``metric`` (B, N, C), the first ``num_prefix`` tokens left
    out; ``r`` is bounded by ``max_merge``. None when nothing is merged."""
    r = min(r, max_merge(metric.shape[1], num_prefix))
    if r <= 0:
        return None
    m = metric[:, num_prefix:]
    m = m / m.norm(dim=-1, keepdim=True)  # cosine similarity (the paper's choice of metric)
    a, b = m[:, ::2], m[:, 1::2]  # (B, ceil(n/2), C), (B, floor(n/2), C): alternate, so both span the image
    scores = a @ b.transpose(-1, -2)  # (B, n_a, n_b)
    best, best_b = scores.max(dim=-1)  # (B, n_a): each A token's most similar B token
    order = best.argsort(dim=-1, descending=True, stable=True)  # (B, n_a): most similar edges first
    src, keep = order[:, :r], order[:, r:]
    return Matching(num_prefix=num_prefix, keep=keep, src=src, dst=best_b.gather(1, src))


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """t (B, n, C)[index (B, k)] -> (B, k, C)."""
    return t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))


def merge_sum(x: Tensor, m: Matching) -> Tensor:
    """x (B, N, C) -> (B, N - r, C): prefix, the kept A tokens, the B tokens with their A tokens added in."""
    P = m.num_prefix
    a, b = x[:, P::2], x[:, P + 1 :: 2]  # (B, n_a, C), (B, n_b, C)
    b = b.scatter_add(1, m.dst[..., None].expand(-1, -1, x.shape[-1]), _rows(a, m.src))
    return torch.cat([x[:, :P], _rows(a, m.keep), b], dim=1)


def merge_wavg(x: Tensor, size: Tensor, m: Matching) -> tuple[Tensor, Tensor]:
    """Size-weighted average: x (B, N, C), size (B, N, 1) -> the merged tokens (each the mean of the
    inputs it holds) and their sizes, (B, N - r, C) and (B, N - r, 1)."""
    total = merge_sum(size, m)
    return merge_sum(x * size, m) / total, total


class TokenMerger:
    """ToMe's state through one forward: each token's ``size`` (B, N, 1) and, with ``trace_source``, its
    ``source`` (B, N, N0) over the N0 input tokens (prefix included). A block calls it with its tokens and
    keys after the attention residual (``EncoderBlock(merge=...)``); ``attn_bias`` is what the next
    attention adds to its logits."""

    def __init__(self, x: Tensor, r: int, num_prefix: int, *, trace_source: bool = False) -> None:
        B, N, _ = x.shape
        self.r, self.num_prefix = r, num_prefix
        self.size = x.new_ones(B, N, 1)
        self.source = torch.eye(N, dtype=x.dtype, device=x.device).expand(B, N, N) if trace_source else None
        self._merged = False

    def attn_bias(self) -> Tensor | None:
        """Proportional attention: log(size) of each key, (B, 1, 1, N); None while every size is 1."""
        return self.size.log().transpose(1, 2)[:, None] if self._merged else None

    def __call__(self, x: Tensor, keys: Tensor) -> Tensor:
        """x (B, N, dim), keys (B, heads, N, head_dim) -> (B, N - r, dim), r bounded by ``max_merge``."""
        m = bipartite_soft_matching(keys.mean(dim=1), self.r, self.num_prefix)
        if m is None:
            return x
        x, self.size = merge_wavg(x, self.size, m)
        if self.source is not None:
            self.source = merge_sum(self.source, m)
        self._merged = True
        return x

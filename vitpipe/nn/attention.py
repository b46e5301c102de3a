"""MultiHeadAttention: the one attention core.

Self-attention (``context=None``), cross-attention (K, V projected from ``context``) and causal
self-attention (``is_causal=True``) are the same module, as in vit-pytorch's ``cross_vit.py`` and
timm/DINOv2's ``is_causal``. The fused path is ``F.scaled_dot_product_attention``; asking for the
weights (``need_weights=True``) takes an explicit softmax path for that call only, so attention
maps never depend on hooks or a process-wide switch (hooks record nothing once SDPA is on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitpipe.nn.rope import apply_rope


@dataclass
class KVCache:
    """Keys and values kept between decoding steps, (B, heads, L, head_dim) each.

    Self-attention appends the new step's K/V; cross-attention fills it once from the context
    and reuses it (the context does not change while decoding).
    """

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search re-ranks hypotheses every step)."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)


def causal_mask(n_query: int, n_key: int, device=None) -> Tensor:
    """Bool (n_query, n_key), True = may attend.

    Queries are the *last* ``n_query`` positions of the ``n_key``-long sequence, so with a KV cache
    (n_query < n_key) query i sees keys 0 .. n_key - n_query + i. Built for the current lengths
    every call; SDPA's own ``is_causal`` aligns top-left, which is wrong once a cache is in use.
    """
    return torch.ones(n_query, n_key, dtype=torch.bool, device=device).tril(diagonal=n_key - n_query)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017).

    Args:
        dim: width of the queries and of the output.
        num_heads: heads; ``dim`` must be divisible by it.
        context_dim: width of the cross-attention context when it differs from ``dim``. ``None``
            gives one fused ``qkv`` projection (timm's layout) which also serves cross-attention
            to a context of width ``dim``.
        qk_norm: LayerNorm on queries and keys per head (Dehghani et al. 2023, ViT-22B), which
            keeps attention logits bounded at scale.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or dim % num_heads != 0:
            raise ValueError(
                f"dim={dim} is not divisible by num_heads={num_heads}; "
                f"choose num_heads among the divisors of {dim} (e.g. {_divisors(dim)})"
            )
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        if context_dim is None:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(context_dim, 2 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: Tensor) -> Tensor:
        B, L, _ = t.shape
        return t.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, heads, L, head_dim)

    def _project(self, x: Tensor, context: Tensor | None, cache: KVCache | None):
        """Queries from x; keys/values from x (self) or context (cross), through the cache."""
        if context is None:
            if not hasattr(self, "qkv"):
                raise ValueError("this attention was built for cross-attention (context_dim set); pass context=")
            B, N, _ = x.shape
            qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)  # each (B, heads, N, head_dim)
            k = self.k_norm(k)
            if cache is not None:
                if cache.k is not None:
                    k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
            return self.q_norm(q), k, v

        if hasattr(self, "qkv"):  # width-`dim` context through the fused weight: Q rows, then K/V rows
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[: self.dim], None if b is None else b[: self.dim])
            kv_fn = lambda c: F.linear(c, w[self.dim :], None if b is None else b[self.dim :])  # noqa: E731
        else:
            q, kv_fn = self.q(x), self.kv
        q = self.q_norm(self._heads(q))
        if cache is not None and cache.k is not None:  # context already projected on an earlier step
            return q, cache.k, cache.v
        B, M, _ = context.shape
        kv = kv_fn(context).view(B, M, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = self.k_norm(kv[0]), kv[1]  # (B, heads, M, head_dim)
        if cache is not None:
            cache.k, cache.v = k, v
        return q, k, v

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` (B, N, dim) to itself or to ``context`` (B, M, context_dim).

        attn_mask: bool, True = may attend, broadcastable to (B, heads, N, M).
        key_padding_mask: bool (B, M), True = padding (ignored), as in ``nn.MultiheadAttention``.
        rope: (cos, sin), each (N, head_dim), rotary phases applied to q and k (self-attention).
        Returns (B, N, dim), or (out, weights (B, heads, N, M)) when ``need_weights``.
        """
        B, N, _ = x.shape
        q, k, v = self._project(x, context, cache)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        M = k.shape[2]

        mask = None if attn_mask is None else attn_mask.to(torch.bool)
        if key_padding_mask is not None:
            keep = ~key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, M)
            mask = keep if mask is None else mask & keep
        sdpa_causal = is_causal and mask is None and N == M  # SDPA's own flag is exact only for N == M
        if is_causal and not sdpa_causal:
            causal = causal_mask(N, M, device=x.device)
            mask = causal if mask is None else mask & causal
        drop = self.attn_drop if self.training else 0.0

        if need_weights:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, heads, N, M)
            if sdpa_causal:
                mask = causal_mask(N, M, device=x.device)
            if mask is not None:
                attn = attn.masked_fill(~mask, float("-inf"))
            weights = attn.softmax(dim=-1)
            out = F.dropout(weights, drop, training=self.training) @ v  # (B, heads, N, head_dim)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=sdpa_causal)

        out = out.transpose(1, 2).reshape(B, N, self.dim)  # (B, N, dim)
        out = self.proj_drop(self.proj(out))
        return (out, weights) if need_weights else out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][-6:]

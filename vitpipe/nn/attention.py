"""MultiHeadAttention: the one attention core for encoder, decoder and cross-attention.

The mode is fixed at construction, as timm and DINOv2 separate ``Attention`` from cross-attention:

- ``context_dim=None``: self-attention with one fused ``qkv`` projection (timm's weight layout);
  ``is_causal=True`` makes it the decoder's causal self-attention, and a ``KVCache`` grows by the
  new tokens' keys and values every call.
- ``context_dim=C``: cross-attention (vit-pytorch's ``cross_vit.py``): ``q`` from x, ``kv`` from a
  context of width C; a ``KVCache`` holds the context's keys and values, projected once.

Both modes then take the same ``_attend``: ``F.scaled_dot_product_attention``, or, when the weights
are asked for (``need_weights=True``), an explicit softmax for that call only, so attention maps
never depend on hooks or a process-wide switch (hooks record nothing once SDPA is on).
``need_logits=True`` returns the pre-softmax logits of the same explicit path (attention health).

``attn_bias`` is a float tensor added to the logits (relative position bias: BEiT, Swin, T5); SDPA
takes it, with any boolean mask folded in as -inf, as its float ``attn_mask``. An ``attn_mask`` that is
a ``torch.nn.attention.flex_attention.BlockMask`` (a sparse pattern, ``vitpipe.nn.patterns``) goes to
``flex_attention``, which never builds the (N, M) matrix where torch compiles it for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitpipe.nn.patterns import compiled_flex_attention, flex_support
from vitpipe.nn.rope import apply_rope

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch: dense masks only
    BlockMask, flex_attention = None, None


@dataclass
class KVCache:
    """Keys and values kept between decoding steps, (B, heads, L, head_dim) each."""

    k: Tensor | None = None
    v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep this call's keys/values after the earlier ones; return all of them."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v

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
        context_dim: ``None`` for self-attention (fused ``qkv``); the context's width for
            cross-attention (``q`` and ``kv`` projections), also when it equals ``dim``.
        qk_norm: LayerNorm on queries and keys per head (Dehghani et al. 2023, ViT-22B), which
            keeps attention logits bounded at scale; eps ``norm_eps`` (1e-6, timm's default; CLIP-style
            models use 1e-5), which is not in the weights, so it is a constructor argument.
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
        norm_eps: float = 1e-6,
        attn_norm: bool = False,
    ) -> None:
        super().__init__()
        if num_heads <= 0 or dim % num_heads != 0:
            raise ValueError(
                f"dim={dim} is not divisible by num_heads={num_heads}; "
                f"choose num_heads among the divisors of {dim} (e.g. {_divisors(dim)})"
            )
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.is_cross = context_dim is not None
        if self.is_cross:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(context_dim, 2 * dim, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.q_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        # a LayerNorm on the heads' concatenated output before proj (NormFormer; EVA-02 CLIP, BEiT-3: timm's scale_norm)
        self.norm = nn.LayerNorm(dim, eps=norm_eps) if attn_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: Tensor, parts: int) -> Tensor:
        """(B, L, parts * dim) -> (parts, B, heads, L, head_dim)."""
        B, L, _ = t.shape
        return t.view(B, L, parts, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)

    def _self_qkv(self, x: Tensor, cache: KVCache | None, rope) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self._heads(self.qkv(x), 3)  # each (B, heads, N, head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # before caching: cached keys keep the phases of their own positions
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, heads, past + N, head_dim)
        return q, k, v

    def _cross_qkv(self, x: Tensor, context: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        q = self.q_norm(self._heads(self.q(x), 1)[0])  # (B, heads, N, head_dim)
        if cache is not None and cache.length:  # the context does not change while decoding: projected once
            return q, cache.k, cache.v
        k, v = self._heads(self.kv(context), 2)  # each (B, heads, M, head_dim)
        k = self.k_norm(k)
        return (q, k, v) if cache is None else (q, *cache.append(k, v))

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        attn_mask=None,
        attn_bias: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        need_logits: bool = False,
        need_keys: bool = False,
        cache: KVCache | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` (B, N, dim) to itself (self-attention) or to ``context`` (B, M, context_dim).

        attn_mask: bool, True = may attend, broadcastable to (B, heads, N, M); or a flex ``BlockMask``.
        attn_bias: float, added to the logits, broadcastable to (B, heads, N, M).
        key_padding_mask: bool (B, M), True = padding (ignored), as in ``nn.MultiheadAttention``.
        is_causal: query i sees keys up to its own position (the last N of M with a cache).
        cache: a ``KVCache`` for incremental decoding (see the module docstring).
        rope: (cos, sin), each (N, head_dim), rotary phases of q and k (self-attention only).
        Returns (B, N, dim), or (out, weights (B, heads, N, M)) when ``need_weights``, or (out,
        pre-softmax logits (B, heads, N, M), masked entries -inf) when ``need_logits``, or (out, keys
        (B, heads, M, head_dim) as attended, after k_norm and rope) when ``need_keys`` (token merging).
        """
        if need_keys and (need_weights or need_logits):
            raise ValueError("need_keys takes no need_weights/need_logits: ask for one extra output per call")
        if self.is_cross and (context is None or rope is not None):
            raise ValueError("cross-attention (built with context_dim) needs context= and takes no rope")
        if not self.is_cross and context is not None:
            raise ValueError("self-attention (built with context_dim=None) takes no context; set context_dim for cross")
        q, k, v = self._cross_qkv(x, context, cache) if self.is_cross else self._self_qkv(x, cache, rope)
        if BlockMask is not None and isinstance(attn_mask, BlockMask):
            out, weights = self._attend_flex(q, k, v, attn_mask, attn_bias, key_padding_mask, is_causal,
                                             need_weights or need_logits)
        else:
            out, weights = self._attend(q, k, v, attn_mask, attn_bias, key_padding_mask, is_causal,
                                        need_weights, need_logits)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.dim)  # (B, N, dim)
        out = self.proj_drop(self.proj(self.norm(out)))
        if need_keys:
            return out, k
        return (out, weights) if need_weights or need_logits else out

    def _attend_flex(self, q: Tensor, k: Tensor, v: Tensor, block_mask, attn_bias, key_padding_mask,
                     is_causal: bool, explicit: bool) -> tuple[Tensor, None]:
        """A sparse pattern through ``flex_attention``: only the blocks the mask keeps are computed."""
        if explicit or attn_bias is not None or key_padding_mask is not None or is_causal:
            raise ValueError("a flex BlockMask pattern takes no need_weights/need_logits, attn_bias, key_padding_mask "
                             "or is_causal; pass the pattern as a boolean attn_mask for those")
        if self.training and self.attn_drop > 0:
            raise ValueError(f"attention dropout ({self.attn_drop}) is not supported with a flex BlockMask pattern")
        if torch.compiler.is_compiling():  # inside a compiled model: flex lowers with the rest of its graph
            return flex_attention(q, k, v, block_mask=block_mask, scale=self.scale), None
        support = flex_support(q.device)
        if not support["backward"] and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise ValueError(f"a flex BlockMask pattern on {q.device.type} is inference only ({support['why']}); run it "
                             "under torch.no_grad(), or build the pattern with backend='sdpa' (or 'auto') to train here")
        # compiled: the fused kernel visits only the kept blocks; eager flex would build the (N, M) scores
        attend = compiled_flex_attention() if support["compiled"] else flex_attention
        return attend(q, k, v, block_mask=block_mask, scale=self.scale), None

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, attn_mask, attn_bias, key_padding_mask, is_causal: bool,
                need_weights: bool, need_logits: bool = False) -> tuple[Tensor, Tensor | None]:
        """q (B, heads, N, head_dim), k/v (B, heads, M, head_dim) -> (out (B, heads, N, head_dim),
        weights, logits or None)."""
        N, M = q.shape[2], k.shape[2]
        mask = None if attn_mask is None else attn_mask.to(torch.bool)
        if key_padding_mask is not None:
            keep = ~key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, M)
            mask = keep if mask is None else mask & keep
        # SDPA's own causal flag is exact only for N == M with no other mask; else an explicit mask
        # torch.onnx cannot decompose SDPA with a float mask (its output reshape becomes an impossible view):
        # under export a bias takes the explicit softmax, the same function
        explicit = need_weights or need_logits or (attn_bias is not None and torch.onnx.is_in_onnx_export())
        sdpa_causal = is_causal and mask is None and attn_bias is None and N == M and not explicit
        if is_causal and not sdpa_causal:
            causal = causal_mask(N, M, device=q.device)
            mask = causal if mask is None else mask & causal
        drop = self.attn_drop if self.training else 0.0
        if not explicit:
            if attn_bias is not None:  # one float mask: the bias, -inf where the boolean mask forbids
                bias = attn_bias.to(q.dtype)
                mask = bias if mask is None else torch.where(mask, bias, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=sdpa_causal, scale=self.scale)
            return out, None
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, heads, N, M)
        if attn_bias is not None:
            attn = attn + attn_bias.to(attn.dtype)
        if mask is not None:
            attn = attn.masked_fill(~mask, float("-inf"))
        weights = attn.softmax(dim=-1)
        return F.dropout(weights, drop) @ v, attn if need_logits else weights if need_weights else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][-6:]

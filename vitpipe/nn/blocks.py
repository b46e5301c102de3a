"""Transformer blocks built on the one attention core.

Pre-norm residual blocks (Xiong et al. 2020), stochastic depth (Huang et al. 2016) and optional
LayerScale (Touvron et al. 2021, CaiT). Submodule names follow timm's ``Block`` so weights map
one to one. MLP, DropPath and LayerScale come from timm.layers.
"""

from __future__ import annotations

from functools import partial

from timm.layers import DropPath, LayerScale, Mlp, QuickGELU, SwiGLU
from torch import Tensor, nn

from vitpipe.nn.attention import KVCache, MultiHeadAttention

# MLP activations by name: exact GELU (ViT), its tanh approximation (SigLIP, big_vision's default) and
# QuickGELU x * sigmoid(1.702 x) (OpenAI CLIP's); "gelu" stays torch's nn.GELU, the one vitpipe always used
MLP_ACTS = {"gelu": nn.GELU, "gelu_tanh": partial(nn.GELU, approximate="tanh"), "quick_gelu": QuickGELU}


def mlp_act_layer(name: str):
    if name not in MLP_ACTS:
        raise ValueError(f"unknown mlp_act={name!r}; valid choices: {', '.join(MLP_ACTS)}")
    return MLP_ACTS[name]


MLPS = ("mlp", "swiglu")


def build_mlp(kind: str, dim: int, hidden: int, *, act: str = "gelu", norm_eps: float | None = None,
              drop: float = 0.0) -> nn.Module:
    """timm's ``Mlp`` (fc1, act, fc2) or ``SwiGLU`` (fc2(silu(fc1_g x) * fc1_x x); Shazeer 2020, EVA-02,
    DINOv3 ViT-S+); ``norm_eps`` adds a LayerNorm on the hidden units (EVA-02's sub-LN, timm's scale_mlp)."""
    norm = partial(nn.LayerNorm, eps=norm_eps) if norm_eps is not None else None
    if kind == "mlp":
        return Mlp(dim, hidden, act_layer=mlp_act_layer(act), norm_layer=norm, drop=drop)
    if kind == "swiglu":
        return SwiGLU(dim, hidden, norm_layer=norm, drop=drop)
    raise ValueError(f"unknown mlp={kind!r}; valid choices: {', '.join(MLPS)}")


def _scale(dim: int, init_values: float | None) -> nn.Module:
    return LayerScale(dim, init_values=init_values) if init_values else nn.Identity()


class EncoderBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); with ``res_post_norm`` x + norm(attn(x)), then
    x + norm(mlp(x)) (Swin-V2's residual post-norm, timm's ``ResPostRelPosBlock``)."""

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 qk_norm: bool = False, proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 init_values: float | None = None, res_post_norm: bool = False, norm_eps: float = 1e-6,
                 mlp_act: str = "gelu", mlp: str = "mlp", mlp_norm: bool = False, attn_norm: bool = False) -> None:
        super().__init__()
        self.res_post_norm = res_post_norm
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = MultiHeadAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                       attn_drop=attn_drop, proj_drop=proj_drop, norm_eps=norm_eps, attn_norm=attn_norm)
        self.ls1, self.drop_path1 = _scale(dim, init_values), DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = build_mlp(mlp, dim, int(dim * mlp_ratio), act=mlp_act, norm_eps=norm_eps if mlp_norm else None,
                             drop=proj_drop)
        self.ls2, self.drop_path2 = _scale(dim, init_values), DropPath(drop_path) if drop_path > 0 else nn.Identity()
        if res_post_norm:  # no LayerScale: the norms' gains start at init_values instead (timm)
            self.ls1 = self.ls2 = nn.Identity()
            if init_values:
                nn.init.constant_(self.norm1.weight, init_values)
                nn.init.constant_(self.norm2.weight, init_values)

    def forward(self, x: Tensor, *, rope=None, key_padding_mask: Tensor | None = None, attn_mask=None,
                attn_bias: Tensor | None = None, need_weights: bool = False,
                need_logits: bool = False, merge=None) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, N, dim); key_padding_mask (B, N) bool, True = padding no token attends to; attn_mask
        and attn_bias as for ``MultiHeadAttention``. ``merge``: token merging between attention and MLP
        (ToMe, ``vitpipe.nn.tome.TokenMerger``), called as merge(x, keys) after the attention residual,
        so the MLP runs on fewer tokens. Returns x, or (x, weights or logits)."""
        explicit = need_weights or need_logits
        y = self.attn(self.attn_input(x), rope=rope, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                      attn_bias=attn_bias, need_weights=need_weights, need_logits=need_logits,
                      need_keys=merge is not None)
        y, extra = y if explicit or merge is not None else (y, None)
        if self.res_post_norm:  # timm's ResPostRelPosBlock (Swin-V2): the norm on the branch's output
            x = x + self.drop_path1(self.norm1(y))
            x = x if merge is None else merge(x, extra)
            x = x + self.drop_path2(self.norm2(self.mlp(x)))
        else:
            x = x + self.drop_path1(self.ls1(y))
            x = x if merge is None else merge(x, extra)
            x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return (x, extra) if explicit else x

    def attn_input(self, x: Tensor) -> Tensor:
        """What the attention of this block reads: norm1(x), or x itself with the residual post-norm."""
        return x if self.res_post_norm else self.norm1(x)


class DecoderBlock(nn.Module):
    """Causal self-attention, then cross-attention to the image tokens (when ``context_dim`` is given), then MLP.

    ``context_dim=None`` gives a decoder-only (prefix-LM) block with no cross-attention module at
    all; its self-attention mask is then passed in by the caller (``attn_mask``).
    """

    def __init__(self, dim: int, num_heads: int, *, context_dim: int | None = None, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, qk_norm: bool = False, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 drop_path: float = 0.0) -> None:
        super().__init__()
        kw = {"qkv_bias": qkv_bias, "qk_norm": qk_norm, "attn_drop": attn_drop, "proj_drop": proj_drop}
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attn = MultiHeadAttention(dim, num_heads, **kw)
        self.has_cross_attention = context_dim is not None
        if self.has_cross_attention:
            self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
            self.cross_attn = MultiHeadAttention(dim, num_heads, context_dim=context_dim, **kw)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, context: Tensor | None = None, *, attn_mask: Tensor | None = None,
                attn_bias: Tensor | None = None, key_padding_mask: Tensor | None = None,
                self_cache: KVCache | None = None, cross_cache: KVCache | None = None, need_weights: bool = False):
        """x (B, T, dim); context (B, M, context_dim). With ``attn_mask`` given, it replaces the causal
        mask (prefix-LM). ``attn_bias``: added to the self-attention logits (T5's relative positions).
        Returns x, or (x, self_weights, cross_weights or None) when ``need_weights``."""
        y = self.self_attn(self.norm1(x), attn_mask=attn_mask, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                           is_causal=attn_mask is None, cache=self_cache, need_weights=need_weights)
        y, w_self = y if need_weights else (y, None)
        x = x + self.drop_path(y)
        w_cross = None
        if self.has_cross_attention:
            y = self.cross_attn(self.norm_cross(x), context, cache=cross_cache, need_weights=need_weights)
            y, w_cross = y if need_weights else (y, None)
            x = x + self.drop_path(y)
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return (x, w_self, w_cross) if need_weights else x

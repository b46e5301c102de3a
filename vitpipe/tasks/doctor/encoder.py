"""The attention core and the image encoder: checks 1 (scale) and 2 (positions).

scale: each attention module against softmax(q k^T / sqrt(d_k)) v written out from its own projections
(Vaswani et al. 2017, eq. 1), fused (SDPA) and explicit path, and against the same with no scale, which
must differ. positions: an image whose patches are shuffled: the output moves iff something positional is
configured (attention and mean pooling are permutation-equivariant and the class token is a fixed query,
so without positions the model sees a set of patches).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vitpipe.models.captioner import Captioner
from vitpipe.models.vit import ViT
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.nn.pos_embed import (
    Learned2DPosEmbed,
    LearnedPosEmbed,
    NoPosEmbed,
    RoPE2D,
    SinCos1DPosEmbed,
    SinCos2DPosEmbed,
)
from vitpipe.tasks.doctor.check import FAIL, PASS, SKIP, TOL, Check, encoder_of, rel

POS_KINDS = {
    NoPosEmbed: "none",
    LearnedPosEmbed: "learned",
    SinCos1DPosEmbed: "sincos1d",
    SinCos2DPosEmbed: "sincos2d",
    Learned2DPosEmbed: "learned2d",
    RoPE2D: "rope2d",
}


def reference_attention(attn: MultiHeadAttention, x: Tensor, context: Tensor | None = None, *, scale: float) -> Tensor:
    """softmax(q k^T * scale) v, projected out, from ``attn``'s own weights (its ``qkv`` or ``q``/``kv``,
    ``q_norm``/``k_norm``, the output ``norm`` of ``attn_norm``, ``proj``), written out here rather than
    through its core. x (B, N, dim), context (B, M, context_dim) -> (B, N, dim)."""
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    if attn.is_cross:
        q = attn.q(x).view(B, N, H, d).transpose(1, 2)  # (B, H, N, d)
        k, v = attn.kv(context).view(B, context.shape[1], 2, H, d).permute(2, 0, 3, 1, 4)  # each (B, H, M, d)
    else:
        q, k, v = attn.qkv(x).view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)  # each (B, H, N, d)
    q, k = attn.q_norm(q), attn.k_norm(k)
    weights = ((q @ k.transpose(-2, -1)) * scale).softmax(dim=-1)  # (B, H, N, M)
    return attn.proj(attn.norm((weights @ v).transpose(1, 2).reshape(B, N, H * d)))  # (B, N, dim); norm: attn_norm


def _scale_probe(attn: MultiHeadAttention, gen: torch.Generator, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """Tokens (2, 16, dim) (and a context (2, 12, context_dim)) whose correctly scaled logits have a spread
    of about 2, so that a missing 1/sqrt(d_k) visibly sharpens the softmax (at init the logits are ~0.01
    and every scale gives the same near-uniform weights)."""
    x = torch.randn(2, 16, attn.dim, generator=gen).to(like)
    context = torch.randn(2, 12, attn.kv.in_features, generator=gen).to(like) if attn.is_cross else None
    for _ in range(3):  # logits grow about quadratically with the input (less with biases, not at all with qk_norm)
        spread = float(_logits(attn, x, context).std())
        if not math.isfinite(spread) or spread == 0:
            break
        gain = (2.0 / spread) ** 0.5
        x = x * gain
        context = None if context is None else context * gain
    return x, context


def _logits(attn: MultiHeadAttention, x: Tensor, context: Tensor | None) -> Tensor:
    B, N, _ = x.shape
    H, d = attn.num_heads, attn.head_dim
    if attn.is_cross:
        q = attn.q(x).view(B, N, H, d).transpose(1, 2)
        k = attn.kv(context).view(B, context.shape[1], 2, H, d)[:, :, 0].transpose(1, 2)
    else:
        q, k = attn.qkv(x).view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)[:2]
    return (attn.q_norm(q) @ attn.k_norm(k).transpose(-2, -1)) * d**-0.5


def check_scale(net: nn.Module, gen: torch.Generator) -> Check:
    """Every attention module, fused and explicit path, against the 1/sqrt(d_k) reference and an unscaled one."""
    like = next(net.parameters())
    worst_scaled, worst_where, nearest_unscaled = 0.0, "", math.inf
    unscaled_where = []
    modules = [(n, m) for n, m in net.named_modules() if isinstance(m, MultiHeadAttention)]
    for name, attn in modules:
        x, context = _scale_probe(attn, gen, like)
        want = reference_attention(attn, x, context, scale=attn.head_dim**-0.5)
        unscaled = reference_attention(attn, x, context, scale=1.0)
        args = (x,) if context is None else (x, context)
        for path, out in (("fused", attn(*args)), ("explicit", attn(*args, need_weights=True)[0])):
            d_scaled, d_unscaled = rel(out, want), rel(out, unscaled)
            if d_scaled > worst_scaled:
                worst_scaled, worst_where = d_scaled, f"{name} ({path})"
            nearest_unscaled = min(nearest_unscaled, d_unscaled)
            if d_unscaled <= TOL:
                unscaled_where.append(f"{name} ({path})")
    measured = (
        f"{worst_scaled:.1e} from the 1/sqrt(d_k) reference, >= {nearest_unscaled:.2g} from an unscaled "
        f"core ({len(modules)} attention modules x fused and explicit path)"
    )
    if worst_scaled <= TOL and nearest_unscaled > 1e3 * TOL:
        return Check("scale", PASS, worst_scaled, measured)
    if worst_scaled <= TOL:  # right, but the probe's logits were too flat to show it
        return Check(
            "scale",
            FAIL,
            worst_scaled,
            measured,
            "the probe could not tell the scaled core from an unscaled one (its logits stayed ~0, e.g. "
            "q_norm/k_norm gains near 0): look at the q_norm/k_norm weights",
        )
    if unscaled_where:
        problem = (
            f"{unscaled_where[0]} computes softmax(q k^T) v with no 1/sqrt(d_k): its logits are "
            f"sqrt(head_dim) too large, so its softmax saturates; look at MultiHeadAttention.scale and the "
            f"scale passed to scaled_dot_product_attention and to the explicit path (vitpipe/nn/attention.py)"
        )
    else:
        problem = (
            f"{worst_where} matches neither softmax(q k^T / sqrt(d_k)) v nor the unscaled form: look at how "
            f"MultiHeadAttention splits q, k, v into heads and scales the logits (vitpipe/nn/attention.py)"
        )
    return Check("scale", FAIL, worst_scaled, measured, problem)


# --------------------------------------------------------------------------- 2. positions


def shuffle_patches(x: Tensor, patch: tuple[int, int], perm: Tensor) -> Tensor:
    """Images (B, C, H, W) whose patch i (row-major on the grid) is patch ``perm[i]`` of ``x``: what the
    network sees as its patch tokens permuted by ``perm``."""
    B, C, H, W = x.shape
    (p, q), (h, w) = patch, (H // patch[0], W // patch[1])
    t = x.reshape(B, C, h, p, w, q).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C, p, q)  # (B, h*w, C, p, q)
    t = t[:, perm]
    return t.reshape(B, h, w, C, p, q).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def positions_on(encoder: ViT) -> list[str]:
    """What gives ``encoder`` a sense of where a patch is, as config values (empty: nothing)."""
    on = []
    kind = POS_KINDS.get(type(encoder.pos_embed), type(encoder.pos_embed).__name__)
    if kind != "none":
        on.append(f"pos_embed={kind}")
    if getattr(encoder, "rel_pos_kind", "none") != "none":
        on.append(f"rel_pos={encoder.rel_pos_kind}")
    if getattr(encoder, "attn_window", None) is not None:
        on.append(f"attn_window={encoder.attn_window}")
    return on


def check_positions(net: nn.Module, gen: torch.Generator) -> Check:
    """The output with the patches shuffled against the output: it must move iff positions are on."""
    encoder = encoder_of(net)
    if getattr(encoder, "stem", "patch") != "patch":
        return Check(
            "positions",
            SKIP,
            None,
            f"stem={encoder.stem}: its 3x3 convolutions see across patch borders, "
            "so a shuffled image is not a permutation of the same tokens",
        )
    (H, W), patch = encoder.img_size, encoder.current_patch_size
    n = (H // patch[0]) * (W // patch[1])
    if n < 2:
        return Check("positions", SKIP, None, "one patch: nothing to shuffle")
    like = next(net.parameters())
    x = torch.randn(2, encoder.in_chans, H, W, generator=gen).to(like)
    perm = torch.randperm(n, generator=gen)
    perm = torch.roll(perm, 1) if torch.equal(perm, torch.arange(n)) else perm  # never the identity
    shuffled = shuffle_patches(x, patch, perm)
    if isinstance(net, Captioner):  # what the words see: the decoder's logits for fixed words
        words = torch.randint(0, net.vocab_size, (2, min(4, net.max_len)), generator=gen).to(like.device)
        out, out_shuffled = (net.decode(words, net.encode(im))[0] for im in (x, shuffled))
        what = "caption logits"
    else:  # what the head reads: the pooled features
        out, out_shuffled = (encoder.forward_head(encoder.forward_features(im), pre_logits=True) for im in (x, shuffled))
        what = f"pooled features (pool={encoder.pool})"
    change = rel(out_shuffled, out)
    on = positions_on(encoder)
    said = ", ".join(on) if on else "pos_embed=none, no relative bias"
    measured = f"shuffling the {n} patches changes the {what} by {change:.2g} ({said}: must {'' if on else 'not '}change)"
    if on and change <= TOL:
        kind = on[0].split("=")[0]
        where = {
            "pos_embed": "the pos_embed module's forward (vitpipe/nn/pos_embed.py) and ViT._embed",
            "rel_pos": "the bias ViT.attn_biases hands each block (vitpipe/nn/rel_pos.py)",
            "attn_window": "the pattern ViT.attn_pattern builds",
        }[kind]
        if on[0] == "pos_embed=rope2d":
            where = "the rope phases ViT.forward_features passes to the blocks (vitpipe/nn/rope.py apply_rope)"
        return Check(
            "positions",
            FAIL,
            change,
            measured,
            f"the config says {said}, but the output ignores where a patch is: positions never reach the tokens; look at {where}",
        )
    if not on and change > TOL:
        return Check(
            "positions",
            FAIL,
            change,
            measured,
            "nothing positional is configured, yet the output depends on where a patch is: something "
            "position-dependent reaches the tokens; look at the pos_embed module (NoPosEmbed must return "
            "x unchanged), the patch stem and any attention mask or bias",
        )
    return Check("positions", PASS, change, measured)

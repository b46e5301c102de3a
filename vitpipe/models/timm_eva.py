"""timm ``Eva`` -> vitpipe ViT: EVA-02, RoPE-ViT (``vit_*_rope_*``), Perception Encoder (``vit_pe_*``),
DINOv3 (``vit_*_dinov3``) and the ``vit_*_rope_reg*_gap`` family.

They are pre-norm ViTs with 2D rotary positions (``ViT(rope=True)`` beside a learned table, or
``pos_embed='rope2d'`` alone) and, for EVA-02 / DINOv3 ViT-S+, SwiGLU MLPs. The conversion is a rename plus:

- ``gamma_1``/``gamma_2`` -> ``ls1.gamma``/``ls2.gamma``; ``q_bias``/``v_bias`` (the key has no bias) or
  separate ``q_proj``/``k_proj``/``v_proj`` -> one fused ``qkv`` (a zero key bias);
- a fused ``GluMlp`` ``fc1`` -> ``SwiGLU``'s ``fc1_g`` (first half: the gate) and ``fc1_x``;
- DINOv3's rotations pair channel j with j + head_dim/2 (``rotate_half``); vitpipe pairs 2j with 2j + 1. The
  query and key channels of each head are permuted (with their biases and qk-norm) so that the pairs line
  up: q.k is unchanged by a permutation applied to both.

Rotary frequencies: EVA's ``RotaryEmbeddingCat`` is vitpipe's ``rope_coords='index'`` (positions are patch
indices, rescaled to ``ref_feat_shape``: ``rope_ref_grid``); DINOv3's ``RotaryEmbeddingDinoV3`` is
``rope_coords='centered'``. RoPE-Mixed (learned per-layer frequencies) is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.models.timm_parts import act_name, attn_pool_kwargs, load_converted, norm_settings
from vitpipe.models.vit import ViT


def _rope_kwargs(tm: nn.Module, unsupported: list[str]) -> dict:
    rope, name = tm.rope, type(tm.rope).__name__
    if rope is None:
        return {}
    if name == "RotaryEmbeddingCat":
        checks = [(rope.in_pixels or getattr(rope, "grid_type", "index") != "index", "pixel-frequency rotary positions")]
        kw = {"rope_coords": "index", "rope_base": float(rope.temperature), "rope_offset": float(rope.grid_offset),
              "rope_ref_grid": None if rope.ref_feat_shape is None else tuple(rope.ref_feat_shape)}
    elif name == "RotaryEmbeddingDinoV3":
        checks = [(rope.temperature is None or rope.min_period is not None, "rotary min/max periods"),
                  (rope.normalize_coords != "separate", f"rope normalize_coords={rope.normalize_coords!r}")]
        kw = {"rope_coords": "centered", "rope_base": float(rope.temperature or 0), "rope_offset": float(rope.grid_offset)}
    else:
        what = "learned per-layer rotary frequencies (RoPE-Mixed)" if name == "RotaryEmbeddingMixed" else name
        unsupported.append(what)
        return {}
    unsupported += [w for bad, w in checks if bad]
    if rope.grid_indexing not in ("ij", "xy"):  # xy: the column's channels first (a permutation, see below)
        unsupported.append(f"rope_grid_indexing={rope.grid_indexing!r}")
    return kw


def _mlp_kwargs(mlp: nn.Module, dim: int, unsupported: list[str]) -> dict:
    name, act = type(mlp).__name__, getattr(mlp, "act", None)
    norm = not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity)
    if name == "Mlp" and act_name(act) is not None:
        return {"mlp": "mlp", "mlp_act": act_name(act), "mlp_ratio": mlp.fc1.out_features / dim, "mlp_norm": norm}
    silu = isinstance(act, nn.SiLU)
    if name == "SwiGLU" and silu:
        return {"mlp": "swiglu", "mlp_ratio": mlp.fc1_g.out_features / dim, "mlp_norm": norm}
    if name == "GluMlp" and silu and not mlp.gate_last and mlp.chunk_dim == -1:
        return {"mlp": "swiglu", "mlp_ratio": mlp.fc1.out_features / 2 / dim, "mlp_norm": norm}
    unsupported.append(f"MLP {name} with {type(act).__name__}")
    return {}


def vit_kwargs_from_timm_eva(tm: nn.Module) -> dict:
    """ViT kwargs equivalent to a timm ``Eva``; ValueError (one line) naming what vitpipe's ViT lacks."""
    blk, dim = tm.blocks[0], tm.embed_dim
    eps, norm_parts = norm_settings(tm)
    unsupported: list[str] = []
    blocks = sorted({f"{type(b).__name__}/{type(b.attn).__name__}" for b in tm.blocks})
    if len(blocks) != 1 or blocks[0] not in ("EvaBlock/EvaAttention", "EvaBlock/AttentionRope"):
        raise ValueError(f"timm Eva uses blocks {', '.join(blocks)}, which vitpipe's ViT does not have "
                         "(it converts pre-norm EvaBlock with EvaAttention or AttentionRope)")
    attn, embed = blk.attn, tm.patch_embed
    rope_kw = _rope_kwargs(tm, unsupported)
    mlp_kw = _mlp_kwargs(blk.mlp, dim, unsupported)
    checks = [
        (type(embed).__name__ != "PatchEmbed" or not isinstance(getattr(embed, "norm", nn.Identity()), nn.Identity),
         f"patch embedding {type(embed).__name__} with a norm"),
        (attn.head_dim * attn.num_heads != dim, "attention width other than dim (attn_head_dim)"),
        (getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads, "grouped-query attention (num_kv_heads)"),
        (getattr(attn, "gate", None) is not None, "gated attention"),
        (attn.proj.bias is None, "proj_bias=False"),
        (blk.gamma_1 is not None and blk.gamma_2 is None, "LayerScale on attention only (attn_only_layer_scale)"),
        (tm.global_pool not in ("token", "avg", "map"), f"global_pool={tm.global_pool!r}"),
        (tm.num_classes > 0 and tm.head.bias is None, "a head without bias"),
    ]
    unsupported += [what for bad, what in checks if bad] + norm_parts
    pool_kw = attn_pool_kwargs(tm.attn_pool, dim, unsupported) if tm.global_pool == "map" else {}
    if unsupported:
        raise ValueError(f"timm Eva uses features vitpipe's ViT does not have: {', '.join(unsupported)}")
    fused = getattr(attn, "qkv", None) is not None
    qkv_bias = (getattr(attn, "q_bias", None) is not None) if fused and type(attn).__name__ == "EvaAttention" \
        else (attn.qkv.bias is not None if fused else attn.q_proj.bias is not None)
    pos = "learned" if tm.pos_embed is not None else ("rope2d" if rope_kw else "none")
    pool_act = act_name(tm.attn_pool.mlp.act) if tm.global_pool == "map" else None
    return {
        "img_size": tuple(embed.img_size), "patch_size": tuple(embed.patch_size), "in_chans": embed.proj.in_channels,
        "num_classes": tm.num_classes, "dim": dim, "depth": len(tm.blocks), "num_heads": attn.num_heads,
        "qkv_bias": qkv_bias, "qk_norm": not isinstance(attn.q_norm, nn.Identity),
        "pos_embed": pos, "rope": bool(rope_kw) and pos == "learned", **rope_kw,
        "class_token": tm.cls_token is not None,
        "reg_tokens": 0 if tm.reg_token is None else tm.reg_token.shape[1],
        "pool": {"token": "cls", "avg": "mean", "map": "map"}[tm.global_pool],
        "pool_include_prefix": tm.global_pool == "map", **pool_kw,  # Eva's attention pool reads every token
        "fc_norm": not isinstance(tm.fc_norm, nn.Identity),
        "final_norm": not (isinstance(tm.norm, nn.Identity) and isinstance(tm.fc_norm, nn.Identity)),
        "pre_norm": not isinstance(tm.norm_pre, nn.Identity), "norm_eps": eps,
        **mlp_kw, "mlp_act": mlp_kw.get("mlp_act") or pool_act or "gelu",
        "attn_norm": not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity),
        "init_values": 1.0 if blk.gamma_1 is not None else None,  # the scales themselves are loaded
        "patch_drop_rate": float(getattr(tm.patch_drop, "prob", 0.0) if tm.patch_drop is not None else 0.0),
    }


def _half_to_pairs(head_dim: int) -> Tensor:
    """Channel order taking timm's rotate_half pairs (j, j + head_dim/2) to vitpipe's (2j, 2j + 1)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=1).flatten()  # (head_dim,)


def _rope_channels(head_dim: int, *, half: bool, xy: bool) -> Tensor | None:
    """The head-channel order (vitpipe channel i reads timm channel perm[i]) that makes timm's rotation
    layout vitpipe's, or None when they agree: vitpipe rotates pairs (2j, 2j + 1), the first half of
    the pairs by the row; timm's ``rotate_half`` pairs (j, j + head_dim/2), and its ``grid_indexing='xy'``
    rotates the first half by the column."""
    if not half and not xy:
        return None
    perm = _half_to_pairs(head_dim) if half else torch.arange(head_dim)  # now in vitpipe's pair layout
    return perm.roll(head_dim // 2) if xy else perm  # xy: swap the two axes' halves


def _permute_qk(t: Tensor, num_heads: int, perm: Tensor) -> Tensor:
    """Permute the query and key channels of each head of a fused qkv weight (3*dim, ...) or bias (3*dim,)."""
    q, k, v = t.chunk(3)
    heads = lambda x: x.unflatten(0, (num_heads, -1))[:, perm].flatten(0, 1)  # noqa: E731 - (heads, head_dim, ...)
    return torch.cat([heads(q), heads(k), v])


def from_timm_eva(tm: nn.Module) -> ViT:
    """A vitpipe ViT with the architecture and weights of a timm ``Eva`` (see the module docstring)."""
    model = ViT(**vit_kwargs_from_timm_eva(tm))
    src = tm.state_dict()
    half = getattr(tm.blocks[0].attn, "rotate_half", False) and tm.rope is not None
    xy = tm.rope is not None and tm.rope.grid_indexing == "xy"
    heads, head_dim = model.blocks[0].attn.num_heads, model.blocks[0].attn.head_dim
    perm = _rope_channels(head_dim, half=half, xy=xy)
    sd: dict[str, Tensor] = {}
    for k, v in src.items():
        if k.startswith("rope.") or k.endswith(".k_bias"):
            continue  # buffers vitpipe computes
        if k == "pos_embed":
            P = 0 if tm.no_embed_class else tm.num_prefix_tokens
            missing = model.num_prefix_tokens - P
            sd["pos_embed.weight"] = torch.cat([v.new_zeros(1, missing, v.shape[-1]), v], dim=1) if missing else v
            continue
        if ".attn.q_bias" in k:
            b = k[: -len("q_bias")]
            sd[b + "qkv.bias"] = torch.cat([v, torch.zeros_like(v), src[b + "v_bias"]])
            continue
        if ".attn.v_bias" in k:
            continue
        if ".attn.q_proj." in k or ".attn.k_proj." in k or ".attn.v_proj." in k:
            if ".attn.q_proj." not in k:
                continue  # joined with q below
            b, leaf = k.split(".attn.q_proj.")
            parts = [src.get(f"{b}.attn.{n}_proj.{leaf}") for n in "qkv"]
            parts = [p if p is not None else torch.zeros_like(parts[0]) for p in parts]  # the key's missing bias
            sd[f"{b}.attn.qkv.{leaf}"] = torch.cat(parts)
            continue
        if k.endswith((".mlp.fc1.weight", ".mlp.fc1.bias")) and type(model.blocks[0].mlp).__name__ == "SwiGLU":
            g, x = v.chunk(2)  # timm's fused GluMlp: fc1 = [gate; value]
            sd[k.replace("fc1.", "fc1_g.")], sd[k.replace("fc1.", "fc1_x.")] = g, x
            continue
        k = k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")
        sd[k] = v
    if perm is not None:
        for k in list(sd):
            if k.endswith((".attn.qkv.weight", ".attn.qkv.bias")):
                sd[k] = _permute_qk(sd[k], heads, perm)
            elif k.endswith((".attn.q_norm.weight", ".attn.q_norm.bias", ".attn.k_norm.weight", ".attn.k_norm.bias")):
                sd[k] = sd[k][perm]
    return load_converted(model, sd, tm)

"""timm <-> vitpipe for the relative-position ViTs: timm's ``VisionTransformerRelPos`` (``vit_relpos_*``,
``vit_srelpos_*``, the residual post-norm ``*_rpn``) and ``Beit`` (``beit_*``).

Both are vitpipe ViTs with ``rel_pos`` set (``vitpipe.nn.rel_pos``), so conversion is a rename:

- ``VisionTransformerRelPos``: ``blocks.i.attn.rel_pos.*`` <-> ``blocks.i.rel_pos.*`` (per block) and
  ``shared_rel_pos.*`` <-> ``rel_pos.*``; the rest has timm's names already. No absolute positions.
- ``Beit``: ``gamma_1``/``gamma_2`` <-> ``ls1.gamma``/``ls2.gamma``; BEiT's ``q_bias`` and ``v_bias`` (its
  key has no bias) <-> the fused ``qkv.bias`` with a zero key part. Going back to BEiT drops vitpipe's key
  bias exactly: q.(k + b) shifts every logit of a query by the same q.b, which softmax ignores
  (without qk_norm, which BEiT does not have and the export refuses).

``from_timm`` and ``to_timm`` in ``vitpipe.models.timm_compat`` send these classes here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.errors import ConfigError
from vitpipe.models.timm_parts import zoo_parts
from vitpipe.models.vit import ViT
from vitpipe.nn.pos_embed import LearnedPosEmbed, NoPosEmbed
from vitpipe.nn.rel_pos import RelPosMlp

TIMM_RELPOS_CLASSES = ("VisionTransformerRelPos", "Beit")


def _rel_pos_kind(module: nn.Module) -> str:
    if type(module).__name__ == "RelPosMlp":
        return f"mlp_{module.mode}"
    if type(module).__name__ in ("RelPosBias", "RelativePositionBias"):
        return "bias"
    raise ValueError(f"timm relative position module {type(module).__name__} has no vitpipe equivalent "
                     "(vitpipe has RelPosBias and RelPosMlp modes cr and swin)")


def _check_eps(tm: nn.Module) -> None:
    eps = sorted({m.eps for m in tm.modules() if isinstance(m, nn.LayerNorm)} - {1e-6})
    if eps:
        raise ValueError(f"timm model uses LayerNorm eps {', '.join(map(str, eps))}; vitpipe's is 1e-6")


def _common(tm: nn.Module, blk: nn.Module) -> dict:
    return {"img_size": tuple(tm.patch_embed.img_size), "patch_size": tuple(tm.patch_embed.patch_size),
            "in_chans": tm.patch_embed.proj.in_channels, "num_classes": tm.num_classes, "dim": tm.embed_dim,
            "depth": len(tm.blocks), "num_heads": blk.attn.num_heads, "mlp_ratio": blk.mlp.fc1.out_features / tm.embed_dim,
            "pool": "cls" if tm.global_pool == "token" else "mean",
            "fc_norm": not isinstance(tm.fc_norm, nn.Identity)}


def vit_kwargs_from_timm_relpos(tm: nn.Module) -> dict:
    """ViT kwargs equivalent to a timm ``VisionTransformerRelPos``."""
    _check_eps(tm)
    if tm.global_pool not in ("token", "avg"):
        raise ValueError(f"timm model uses global_pool={tm.global_pool!r}; vitpipe pools by 'token' or 'avg'")
    blk = tm.blocks[0]
    post = type(blk).__name__ == "ResPostRelPosBlock"
    rel = tm.shared_rel_pos if tm.shared_rel_pos is not None else blk.attn.rel_pos
    kind = "none" if rel is None else _rel_pos_kind(rel)
    return {**_common(tm, blk), "qkv_bias": blk.attn.qkv.bias is not None,
            "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity), "pos_embed": "none",
            "class_token": tm.cls_token is not None, "rel_pos": kind, "rel_pos_shared": tm.shared_rel_pos is not None,
            "rel_pos_dim": rel.mlp.fc1.out_features if kind.startswith("mlp") else None, "res_post_norm": post,
            # LayerScale: the value itself is loaded; the post-norm block has none (its norms' gains instead)
            "init_values": None if post or not hasattr(blk.ls1, "gamma") else 1.0}


def vit_kwargs_from_timm_beit(tm: nn.Module) -> dict:
    """ViT kwargs equivalent to a timm ``Beit``."""
    _check_eps(tm)
    blk = tm.blocks[0]
    if type(blk.mlp).__name__ != "Mlp":
        raise ValueError(f"timm Beit uses a {type(blk.mlp).__name__} MLP (BEiT-v2/EVA style); vitpipe's is Mlp with GELU")
    per_block = blk.attn.relative_position_bias_table is not None
    return {**_common(tm, blk), "qkv_bias": blk.attn.q_bias is not None, "qk_norm": False,
            "pos_embed": "none" if tm.pos_embed is None else "learned", "class_token": True,
            "rel_pos": "bias" if per_block or tm.rel_pos_bias is not None else "none",
            "rel_pos_shared": tm.rel_pos_bias is not None and not per_block,
            "init_values": None if blk.gamma_1 is None else 1.0}


def from_timm_relpos(tm: nn.Module) -> ViT:
    """A vitpipe ViT with the architecture and weights of a timm ``VisionTransformerRelPos`` or ``Beit``."""
    beit = type(tm).__name__ == "Beit"
    model = ViT(**(vit_kwargs_from_timm_beit(tm) if beit else vit_kwargs_from_timm_relpos(tm)))
    sd: dict[str, Tensor] = {}
    for k, v in tm.state_dict().items():
        if k.endswith(("relative_position_index", ".k_bias")):
            continue  # buffers vitpipe computes (timm stores some in older checkpoints)
        if beit and k.endswith(".attn.q_bias"):
            v_bias = tm.state_dict()[k[: -len("q_bias")] + "v_bias"]
            sd[k[: -len("q_bias")] + "qkv.bias"] = torch.cat([v, torch.zeros_like(v), v_bias])
            continue
        if beit and k.endswith(".attn.v_bias"):
            continue
        k = k.replace(".attn.rel_pos.", ".rel_pos.")
        k = k.replace(".attn.relative_position_bias_table", ".rel_pos.relative_position_bias_table")
        k = k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")
        if k.startswith(("shared_rel_pos.", "rel_pos_bias.")):
            k = "rel_pos." + k.split(".", 1)[1]
        if k == "pos_embed":
            k = "pos_embed.weight"
        sd[k] = v
    model.load_state_dict(sd)
    return model.train(tm.training)


def _rel_pos_module(model: ViT) -> nn.Module | None:
    return model.rel_pos if model.rel_pos is not None else model.blocks[0].rel_pos


def timm_relpos_target(model: ViT) -> str:
    """Which timm class expresses ``model``: 'beit' for the BEiT layout (a table, a class token, pre-norm
    blocks, no qk_norm; learned or no absolute positions), else 'relpos' (``VisionTransformerRelPos``,
    which has no absolute positions); ConfigError naming what neither can express."""
    blk, parts = model.blocks[0], []
    if model.num_prefix_tokens != int(model.class_token):
        parts.append("register or distillation tokens")
    if model.patch_embed.__class__.__name__ != "PatchEmbed":
        parts.append("the conv stem (stem=conv)")
    if model.attn_window is not None:
        parts.append("local attention (attn_window)")
    parts += zoo_parts(model, can=("fc_norm",))
    beit = model.rel_pos_kind == "bias" and model.class_token and not blk.res_post_norm \
        and isinstance(blk.attn.q_norm, nn.Identity) and isinstance(model.pos_embed, (NoPosEmbed, LearnedPosEmbed))
    if not beit and not isinstance(model.pos_embed, NoPosEmbed):
        parts.append(f"rel_pos={model.rel_pos_kind} with pos_embed={type(model.pos_embed).__name__} (timm's relpos ViT "
                     "has no absolute positions; its Beit takes rel_pos=bias with learned positions, a class token, "
                     "pre-norm blocks and no qk_norm)")
    if parts:
        raise ConfigError(f"timm cannot express {', '.join(parts)}; export with format=onnx")
    return "beit" if beit else "relpos"


def timm_relpos_arch(model: ViT) -> str:
    """The timm entry point ``to_timm_relpos`` builds through (the kwargs set every dimension); the
    residual post-norm block comes with its entry point, since timm records kwargs as JSON."""
    if timm_relpos_target(model) == "beit":
        return "beit_base_patch16_224"
    return "vit_relpos_base_patch16_rpn_224" if model.blocks[0].res_post_norm else "vit_relpos_base_patch16_224"


def to_timm_relpos(model: ViT, arch: str | None = None) -> nn.Module:
    """A timm ``VisionTransformerRelPos`` or ``Beit`` with ``model``'s weights: the inverse of ``from_timm_relpos``."""
    import timm

    target, blk, rel = timm_relpos_target(model), model.blocks[0], _rel_pos_module(model)
    arch = arch or timm_relpos_arch(model)
    kw = {"img_size": tuple(model.img_size), "patch_size": tuple(model.patch_size), "in_chans": model.in_chans,
          "num_classes": model.num_classes, "embed_dim": model.dim, "depth": len(model.blocks),
          "num_heads": blk.attn.num_heads, "mlp_ratio": blk.mlp.fc1.out_features / model.dim,
          "qkv_bias": blk.attn.qkv.bias is not None, "global_pool": "token" if model.pool == "cls" else "avg"}
    fc_norm = not isinstance(model.fc_norm, nn.Identity)
    # init_values=0.0, not None: timm.create_model drops None kwargs (the entry point's LayerScale would stay)
    sd: dict[str, Tensor] = {}
    if target == "relpos":
        kw.update(qk_norm=not isinstance(blk.attn.q_norm, nn.Identity), class_token=model.class_token,
                  fc_norm=fc_norm, shared_rel_pos=model.rel_pos is not None,
                  rel_pos_type={"bias": "bias", "mlp_cr": "mlp", "mlp_swin": "mlp_swin"}[model.rel_pos_kind],
                  rel_pos_dim=rel.mlp.fc1.out_features if isinstance(rel, RelPosMlp) else None,
                  init_values=0.0 if blk.res_post_norm or not hasattr(blk.ls1, "gamma") else 1.0)
        tm = timm.create_model(arch, pretrained=False, **kw)
        for k, v in model.state_dict().items():
            if k.startswith("rel_pos."):
                k = "shared_rel_pos." + k[len("rel_pos."):]
            sd[k.replace(".rel_pos.", ".attn.rel_pos.")] = v
    else:
        kw.update(use_abs_pos_emb=not isinstance(model.pos_embed, NoPosEmbed), use_rel_pos_bias=model.rel_pos is None,
                  use_shared_rel_pos_bias=model.rel_pos is not None, use_fc_norm=fc_norm,
                  init_values=0.1 if hasattr(blk.ls1, "gamma") else 0.0)
        tm = timm.create_model(arch, pretrained=False, **kw)
        for k, v in model.state_dict().items():
            if k.endswith(".attn.qkv.bias"):
                q, _, v_ = v.chunk(3)  # the key's bias: no effect on softmax (module docstring)
                sd[k.replace("qkv.bias", "q_bias")], sd[k.replace("qkv.bias", "v_bias")] = q, v_
                continue
            k = k.replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2")
            k = k.replace(".rel_pos.relative_position_bias_table", ".attn.relative_position_bias_table")
            if k.startswith("rel_pos."):
                k = "rel_pos_bias." + k[len("rel_pos."):]
            sd["pos_embed" if k == "pos_embed.weight" else k] = v
    missing, unexpected = tm.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("relative_position_index", "k_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"timm state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return tm.train(model.training)


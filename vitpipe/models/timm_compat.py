"""timm <-> vitpipe: build from a timm ``VisionTransformer`` or ``NaFlexVit`` (and back to a
``VisionTransformer``, ``to_timm``). Loading timm or file weights into a ViT is ``vitpipe.models.weights``.

Block and head parameter names are timm's, so conversion is one rename (``pos_embed`` ->
``pos_embed.weight``) plus the adaptations any checkpoint move needs: positions resampled to
the new grid, a head with another class count left freshly initialised.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.errors import ConfigError
from vitpipe.models.timm_eva import from_timm_eva
from vitpipe.models.timm_parts import act_name, attn_pool_kwargs, load_converted, norm_settings, zoo_parts
from vitpipe.models.timm_relpos import TIMM_RELPOS_CLASSES, from_timm_relpos, timm_relpos_arch, to_timm_relpos
from vitpipe.models.vit import ViT
from vitpipe.nn.patch_embed import PatchEmbed
from vitpipe.nn.pos_embed import (
    Learned2DPosEmbed,
    LearnedPosEmbed,
    NoPosEmbed,
    RoPE2D,
    SinCosPosEmbed,
)

# timm classes from_timm does not convert, and why (the refusal's sentence)
UNCONVERTED_CLASSES = {
    "VisionTransformerSAM": "SAM's image encoder: windowed attention with decomposed relative positions and a conv neck",
}
CONVERTED_CLASSES = ("VisionTransformer", "VisionTransformerDistilled", "Eva", "NaFlexVit", *TIMM_RELPOS_CLASSES)


def vit_kwargs_from_timm(tm: nn.Module) -> dict:
    """ViT constructor kwargs equivalent to a timm ``VisionTransformer`` (or ``VisionTransformerDistilled``);
    ValueError, one line, naming every feature vitpipe does not have (a CNN stem, parallel blocks, ...)."""
    blk, dim = tm.blocks[0], tm.embed_dim
    blocks = sorted({type(b).__name__ for b in tm.blocks})
    if blocks not in (["Block"], ["ResPostBlock"]):
        raise ValueError(f"timm model uses block type {'/'.join(blocks)}, which vitpipe's ViT does not have (it has "
                         "timm's pre-norm Block and ResPostBlock)")
    attn, mlp, embed = blk.attn, blk.mlp, tm.patch_embed
    eps, norm_parts = norm_settings(tm)
    act = act_name(getattr(mlp, "act", None)) if type(mlp).__name__ == "Mlp" else None
    checks = [
        (type(embed).__name__ != "PatchEmbed", f"patch embedding {type(embed).__name__} (a CNN or hybrid stem)"),
        (not isinstance(getattr(embed, "norm", nn.Identity()), nn.Identity), "a norm in the patch embedding"),
        (type(attn).__name__ != "Attention", f"attention module {type(attn).__name__}"),
        (getattr(attn, "head_dim", dim // blk.attn.num_heads) * attn.num_heads != dim, "attention width other than dim"),
        (type(mlp).__name__ != "Mlp", f"MLP {type(mlp).__name__}"),
        (type(mlp).__name__ == "Mlp" and act is None, f"MLP activation {type(getattr(mlp, 'act', None)).__name__}"),
        (attn.proj.bias is None or getattr(getattr(mlp, "fc1", None), "bias", 0) is None, "proj_bias=False"),
        (tm.global_pool not in ("token", "avg", "map"), f"global_pool={tm.global_pool!r}"),
        (tm.pool_include_prefix and tm.global_pool == "token", "pool_include_prefix with token pooling"),
        (tm.num_classes > 0 and tm.head.bias is None, "a head without bias"),
    ]
    unsupported = [what for bad, what in checks if bad] + norm_parts
    pool_kw = attn_pool_kwargs(tm.attn_pool, dim, unsupported) if tm.global_pool == "map" and not unsupported else {}
    if pool_kw and act_name(tm.attn_pool.mlp.act) != act:
        unsupported.append("attention pooling with another MLP activation than the blocks'")
    if unsupported:
        raise ValueError(f"timm model uses features vitpipe's ViT does not have: {', '.join(unsupported)}")
    post = blocks == ["ResPostBlock"]
    return {
        "img_size": tuple(embed.img_size),
        "patch_size": tuple(embed.patch_size),
        "in_chans": embed.proj.in_channels,
        "num_classes": tm.num_classes,
        "dim": dim,
        "depth": len(tm.blocks),
        "num_heads": attn.num_heads,
        "mlp_ratio": mlp.fc1.out_features / dim,
        "qkv_bias": attn.qkv.bias is not None,
        "qk_norm": not isinstance(attn.q_norm, nn.Identity),
        "pos_embed": "none" if tm.pos_embed is None else "learned",
        "class_token": tm.cls_token is not None,
        "dist_token": getattr(tm, "dist_token", None) is not None,  # VisionTransformerDistilled (DeiT)
        "reg_tokens": tm.num_reg_tokens,
        "pool": {"token": "cls", "avg": "mean", "map": "map"}[tm.global_pool],
        "pool_include_prefix": bool(tm.pool_include_prefix), **pool_kw,
        # timm decides where its final norm goes by its own fc_norm rule: read where it went
        "fc_norm": not isinstance(tm.fc_norm, nn.Identity),
        "final_norm": not (isinstance(tm.norm, nn.Identity) and isinstance(tm.fc_norm, nn.Identity)),
        "pre_norm": not isinstance(tm.norm_pre, nn.Identity),
        "norm_eps": eps,
        "mlp_act": act,
        "mlp_norm": not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity),  # timm's scale_mlp_norm
        "attn_norm": not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity),  # scale_attn_norm
        "res_post_norm": post,
        # a LayerScale has a gamma (timm <= 1.0.20 has its own class in vision_transformer.py, not timm.layers')
        "init_values": 1.0 if not post and hasattr(blk.ls1, "gamma") else None,  # the value itself is loaded
        "patch_drop_rate": float(getattr(tm.patch_drop, "prob", 0.0)),  # PatchDropout, or an Identity when off
    }


def _refuse_class(tm: nn.Module) -> None:
    """ValueError (one line) for a timm class ``from_timm`` does not convert."""
    name = type(tm).__name__
    if name not in CONVERTED_CLASSES:
        why = UNCONVERTED_CLASSES.get(name, "a model family vitpipe's ViT does not express")
        raise ValueError(f"timm {name} ({why}) has no vitpipe equivalent; from_timm converts "
                         f"{', '.join(CONVERTED_CLASSES)}")


def from_timm(tm: nn.Module) -> ViT:
    """A vitpipe ViT with the architecture and weights of a timm ``VisionTransformer``,
    ``VisionTransformerDistilled``, ``Eva`` (``vitpipe.models.timm_eva``), ``NaFlexVit``,
    ``VisionTransformerRelPos`` or ``Beit`` (``vitpipe.models.timm_relpos``); for anything else a
    one-line ValueError naming what it lacks
    (``python -m vitpipe.models.timm_zoo`` scans timm's entry points)."""
    _refuse_class(tm)
    if type(tm).__name__ == "NaFlexVit":
        return from_timm_naflex(tm)
    if type(tm).__name__ in TIMM_RELPOS_CLASSES:
        return from_timm_relpos(tm)
    if type(tm).__name__ == "Eva":
        return from_timm_eva(tm)
    model = ViT(**vit_kwargs_from_timm(tm))
    sd = timm_to_vitpipe(tm.state_dict(), num_prefix_tokens=0 if tm.no_embed_class else tm.num_prefix_tokens,
                         model=model)
    return load_converted(model, sd, tm)


def vit_kwargs_from_timm_naflex(tm: nn.Module) -> dict:
    """ViT constructor kwargs equivalent to a timm ``NaFlexVit``; ValueError naming the settings vitpipe
    does not have. The built grid is timm's ``pos_embed_grid_size``; its ``pos_embed_ar_preserving`` is
    the positional module's ``ar_preserving`` (set by ``from_timm_naflex``, not a ViT argument)."""
    from timm.models.vision_transformer import Block

    e, blk = tm.embeds, tm.blocks[0]
    learned = e.pos_embed_type in ("learned", "factorized")
    eps, norms = norm_settings(tm)
    mlp_types = sorted({type(b.mlp).__name__ for b in tm.blocks})
    acts = {act_name(getattr(b.mlp, "act", None)) for b in tm.blocks}
    unsupported = norms + [
        name for name, on in [
            (f"block type {type(blk).__name__} (rope/EVA/SwiGLU blocks)", any(type(b) is not Block for b in tm.blocks)),
            (f"MLP {'/'.join(mlp_types)}", mlp_types != ["Mlp"]),
            (f"MLP activation {type(getattr(blk.mlp, 'act', None)).__name__}",
             mlp_types == ["Mlp"] and (None in acts or len(acts) > 1)),
            ("a norm inside attention or the MLP", any(not isinstance(getattr(m, "norm", nn.Identity()), nn.Identity)
                                                       for b in tm.blocks for m in (b.attn, b.mlp))),
            ("rope", tm.rope is not None),
            ("global_pool=" + repr(tm.global_pool), tm.global_pool not in ("token", "avg", "map")),
            ("pool_include_prefix=True", tm.pool_include_prefix),
            ("an embedding norm (embed_norm_layer / input_norm_layer)",
             not isinstance(e.norm, nn.Identity) or e.norm_input is not None),
            ("proj_bias=False", blk.attn.proj.bias is None),
            ("patchify_channels_last=False", not e.channels_last),
            ("pos_embed_use_grid_sample=True", learned and e.pos_embed_use_grid_sample),
            (f"pos_embed_interp_mode={e.pos_embed_interp_mode!r}",
             e.pos_embed_type == "learned" and e.pos_embed_interp_mode != "bicubic"),
            ("pos_embed_antialias=False", e.pos_embed_type == "learned" and not e.pos_embed_antialias),
            ("pos_embed_align_corners=True", e.pos_embed_type == "learned" and e.pos_embed_align_corners),
        ] if on
    ]
    if unsupported:
        raise ValueError(f"timm NaFlexVit uses settings vitpipe's ViT does not have: {', '.join(unsupported)}; "
                         "vitpipe converts learned/factorized positions with avg, token or map pooling (e.g. "
                         "naflexvit_base_patch16_gap, naflexvit_base_patch16_par_gap, naflexvit_base_patch16_parfac_gap)")
    parts: list[str] = []
    pool_kw = attn_pool_kwargs(tm.attn_pool, tm.embed_dim, parts) if tm.global_pool == "map" else {}
    if parts or (pool_kw and act_name(tm.attn_pool.mlp.act) not in acts):
        raise ValueError(f"timm NaFlexVit uses settings vitpipe's ViT does not have: "
                         f"{', '.join(parts) or 'attention pooling with another MLP activation'}")
    dim, patch = tm.embed_dim, tuple(e.patch_size)
    grid = tuple(e.pos_embed_grid_size or (1, 1))  # no learned table: any grid, the tensor path needs one
    return {
        "img_size": (grid[0] * patch[0], grid[1] * patch[1]), "patch_size": patch, "in_chans": e.in_chans,
        "num_classes": tm.num_classes, "dim": dim, "depth": len(tm.blocks), "num_heads": blk.attn.num_heads,
        "mlp_ratio": blk.mlp.fc1.out_features / dim, "qkv_bias": blk.attn.qkv.bias is not None,
        "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity),
        "pos_embed": {"learned": "learned", "factorized": "learned2d"}.get(e.pos_embed_type, "none"),
        "class_token": tm.has_class_token, "reg_tokens": tm.num_reg_tokens,
        "pool": {"token": "cls", "avg": "mean", "map": "map"}[tm.global_pool], **pool_kw,
        "fc_norm": not isinstance(tm.fc_norm, nn.Identity),
        "final_norm": not (isinstance(tm.norm, nn.Identity) and isinstance(tm.fc_norm, nn.Identity)),
        "pre_norm": not isinstance(tm.norm_pre, nn.Identity), "norm_eps": eps, "mlp_act": acts.pop(),
        "init_values": 1.0 if hasattr(blk.ls1, "gamma") else None,  # the scales themselves are loaded
        "pos_embed_naflex_rule": learned,  # image tensors: timm's patch-dict resampling, as timm runs them
    }


def from_timm_naflex(tm: nn.Module) -> ViT:
    """A vitpipe ViT with the architecture and weights of a timm ``NaFlexVit``: the same logits for the
    same patch dict, and on the same image tensor at any grid (``pos_embed_naflex_rule``: a tensor's
    positions are resampled as timm resamples the patch dict of its whole grid)."""
    model = ViT(**vit_kwargs_from_timm_naflex(tm))
    if hasattr(model.pos_embed, "ar_preserving"):  # timm's gap (False) or par/parfac (True) resampling rule
        model.pos_embed.ar_preserving = bool(tm.embeds.pos_embed_ar_preserving)
    P = model.num_prefix_tokens
    sd = {}
    for k, v in tm.state_dict().items():
        if k == "embeds.proj.weight" and v.ndim == 2:  # linear (dim, p*q*C), channel fastest -> conv (dim, C, p, q)
            p, q = model.patch_size
            sd["patch_embed.proj.weight"] = v.reshape(v.shape[0], p, q, model.in_chans).permute(0, 3, 1, 2)
        elif k == "embeds.pos_embed":  # (1, h, w, dim), patches only: prefix tokens get zero rows
            sd["pos_embed.weight"] = torch.cat([v.new_zeros(1, P, v.shape[-1]), v.flatten(1, 2)], dim=1)
        elif k in ("embeds.pos_embed_y", "embeds.pos_embed_x"):  # (1, h or w, dim)
            sd["pos_embed.row" if k.endswith("_y") else "pos_embed.col"] = v[0]
        elif k.startswith("embeds."):  # proj (conv or bias), cls_token, reg_token
            sd[("patch_embed." if k.startswith("embeds.proj.") else "") + k[len("embeds."):]] = v
        else:
            sd[k] = v
    return load_converted(model, sd, tm)


def timm_to_vitpipe(sd: dict[str, Tensor], *, num_prefix_tokens: int, model: ViT) -> dict[str, Tensor]:
    """Rename timm keys; give prefix tokens zero positions when the source had none
    (``no_embed_class=True``: DeiT-III, big_vision)."""
    sd = dict(sd)
    if "pos_embed" in sd:
        pe = sd.pop("pos_embed")
        missing = model.num_prefix_tokens - num_prefix_tokens
        if missing > 0:
            pe = torch.cat([pe.new_zeros(1, missing, pe.shape[-1]), pe], dim=1)
        sd["pos_embed.weight"] = pe
    return sd


def vitpipe_to_timm(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse rename, for exporting to timm (learned positions only)."""
    sd = dict(sd)
    if "pos_embed.weight" in sd:
        sd["pos_embed"] = sd.pop("pos_embed.weight")
    return sd


def timm_kwargs(model: ViT) -> dict:
    """``VisionTransformer`` kwargs computing what ``model`` computes; ConfigError naming a part timm
    cannot express. Fixed sin-cos tables become timm's position table holding the fixed values
    (``no_embed_class``: prefix tokens get no position, as in vitpipe)."""
    parts = _unmapped_parts(model, [
        (getattr(model, "rel_pos_kind", "none") != "none", "relative position bias (timm_relpos_arch builds it)"),
        (isinstance(getattr(model, "pos_embed", None), RoPE2D), "rope2d positions (rotary q/k)"),
        (isinstance(getattr(model, "pos_embed", None), Learned2DPosEmbed),
         "learned2d positions (a row table plus a column table)")])
    parts += zoo_parts(model, can=("pre_norm", "final_norm", "mlp_act", "map", "fc_norm", "pool_include_prefix",
                                   "mlp_norm", "attn_norm"))
    if isinstance(model, ViT) and model.pre_norm and model.patch_embed.proj.bias.any():
        parts.append("pre_norm with a patch embedding bias (timm drops that bias with pre_norm)")
    if parts:
        raise ConfigError(f"timm's VisionTransformer cannot express {', '.join(parts)}; export with format=onnx")
    blk = model.blocks[0]
    fixed = isinstance(model.pos_embed, SinCosPosEmbed)
    return {
        "img_size": tuple(model.img_size), "patch_size": tuple(model.patch_size), "in_chans": model.in_chans,
        "num_classes": model.num_classes, "embed_dim": model.dim, "depth": len(model.blocks),
        "num_heads": blk.attn.num_heads,
        "mlp_ratio": blk.mlp.fc1.out_features / model.dim, "qkv_bias": blk.attn.qkv.bias is not None,
        "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity),  # timm's LayerNorm, eps 1e-6 as vitpipe's
        "init_values": 1.0 if hasattr(blk.ls1, "gamma") else None,  # the scales themselves are loaded
        "class_token": model.class_token, "reg_tokens": model.num_prefix_tokens - int(model.class_token),
        "global_pool": {"cls": "token", "mean": "avg", "map": "map"}[model.pool],
        "pool_include_prefix": model.pool_include_prefix,
        "fc_norm": not isinstance(model.fc_norm, nn.Identity),
        "final_norm": not (isinstance(model.norm, nn.Identity) and isinstance(model.fc_norm, nn.Identity)),
        "pre_norm": model.pre_norm, "act_layer": model.mlp_act,
        "scale_mlp_norm": isinstance(getattr(blk.mlp, "norm", None), nn.LayerNorm),
        "scale_attn_norm": isinstance(blk.attn.norm, nn.LayerNorm),
        "pos_embed": "none" if isinstance(model.pos_embed, NoPosEmbed) else "learn", "no_embed_class": fixed,
        "patch_drop_rate": getattr(model, "patch_drop_rate", 0.0),  # timm has no ToMe: tome_r is vitpipe's only
    }


def timm_arch_of(model: ViT, arch: str) -> str:
    """``arch`` for a plain ViT; timm's relative-position entry point for a model with ``rel_pos``."""
    return timm_relpos_arch(model) if getattr(model, "rel_pos_kind", "none") != "none" else arch


def _unmapped_parts(model, pos_parts: list[tuple[bool, str]]) -> list[str]:
    """What of ``model`` a timm class cannot express: the position kinds flagged in ``pos_parts``
    (condition, description), the conv stem, a distillation token; or that it is no vitpipe ViT."""
    if not isinstance(model, ViT):
        return [f"the network type {type(model).__name__} (only vitpipe's ViT maps to timm)"]
    checks = [*pos_parts, (type(model.patch_embed) is not PatchEmbed, "the conv stem (stem=conv)"),
              (getattr(model, "attn_window", None) is not None, "local attention (attn_window)"),
              (getattr(model, "tome_r", 0) > 0, f"token merging (tome_r={getattr(model, 'tome_r', 0)}; timm has no ToMe)"),
              (getattr(model, "dist_token", None) is not None, "the distillation token (dist_token=true)")]
    return [what for bad, what in checks if bad]


def to_timm(model: ViT, arch: str = "vit_base_patch16_224") -> nn.Module:
    """A timm ``VisionTransformer`` (built through ``timm.create_model(arch, **timm_kwargs(model))``,
    so timm records its arguments) with ``model``'s weights: the inverse of ``from_timm``. A model with
    relative position bias becomes timm's ``VisionTransformerRelPos`` or ``Beit`` (``timm_arch`` names it)."""
    import timm

    if getattr(model, "rel_pos_kind", "none") != "none":
        return to_timm_relpos(model, arch if arch.startswith(("vit_relpos", "beit")) else None)
    tm = timm.create_model(arch, pretrained=False, **timm_kwargs(model))
    sd = vitpipe_to_timm(model.state_dict())
    if tm.patch_embed.proj.bias is None:  # pre_norm: timm has no bias there (checked zero by timm_kwargs)
        sd.pop("patch_embed.proj.bias")
    if isinstance(model.pos_embed, SinCosPosEmbed):
        sd["pos_embed"] = model.pos_embed.table.detach().clone()  # (1, h*w, dim): the table it is
    tm.load_state_dict(sd)
    return tm.train(model.training)


NAFLEX_ARCHS = {("learned", True): "naflexvit_base_patch16_par_gap", ("learned2d", True): "naflexvit_base_patch16_parfac_gap",
                ("learned", False): "naflexvit_base_patch16_gap", ("learned2d", False): "naflexvit_base_patch16_gap",
                ("none", False): "naflexvit_base_patch16_gap", ("none", True): "naflexvit_base_patch16_gap"}


def _pos_kind(model: ViT) -> str | None:
    kinds = {LearnedPosEmbed: "learned", Learned2DPosEmbed: "learned2d", NoPosEmbed: "none"}
    return kinds.get(type(model.pos_embed))


def naflex_timm_kwargs(model: ViT) -> dict:
    """``NaFlexVit`` kwargs computing on a patch dict what ``model`` computes; ConfigError (one line)
    naming every part a NaFlexVit cannot express. The inverse of ``vit_kwargs_from_timm_naflex``."""
    parts = _unmapped_parts(model, [
        (isinstance(model, ViT) and _pos_kind(model) is None,
         f"pos_embed={type(getattr(model, 'pos_embed', None)).__name__} (NaFlexVit takes learned, learned2d or none)")])
    parts += zoo_parts(model)
    if parts:
        raise ConfigError(f"timm's NaFlexVit cannot express {', '.join(parts)}; export with format=onnx")
    blk, kind = model.blocks[0], _pos_kind(model)
    ar = bool(getattr(model.pos_embed, "ar_preserving", False))
    return {
        "patch_size": tuple(model.patch_size), "in_chans": model.in_chans, "num_classes": model.num_classes,
        "embed_dim": model.dim, "depth": len(model.blocks), "num_heads": blk.attn.num_heads,
        "mlp_ratio": blk.mlp.fc1.out_features / model.dim, "qkv_bias": blk.attn.qkv.bias is not None,
        "qk_norm": not isinstance(blk.attn.q_norm, nn.Identity),
        "init_values": 1.0 if hasattr(blk.ls1, "gamma") else None,  # the scales themselves are loaded
        "class_token": model.class_token, "reg_tokens": model.num_prefix_tokens - int(model.class_token),
        "global_pool": "token" if model.pool == "cls" else "avg", "fc_norm": model.pool == "mean",
        "pos_embed": {"learned": "learned", "learned2d": "factorized", "none": "none"}[kind],
        "pos_embed_grid_size": tuple(model.grid_size), "pos_embed_ar_preserving": ar,
    }


def naflex_arch(model: ViT) -> str:
    """timm's NaFlexVit entry point whose positional rule is ``model``'s (the model_args set every dimension)."""
    return NAFLEX_ARCHS[(_pos_kind(model), bool(getattr(model.pos_embed, "ar_preserving", False)))]


def to_timm_naflex(model: ViT, arch: str | None = None) -> nn.Module:
    """A timm ``NaFlexVit`` (``timm.create_model(arch, **naflex_timm_kwargs(model))``) with ``model``'s
    weights: the same logits on the same patch dict; the inverse of ``from_timm_naflex``.

    timm's table covers patches only; the rows vitpipe's learned table holds for prefix tokens are a
    constant added to a constant, so they are folded into ``cls_token`` / ``reg_token``."""
    import timm

    kw = naflex_timm_kwargs(model)
    tm = timm.create_model(arch or naflex_arch(model), pretrained=False, **kw)
    P, sd = model.num_prefix_tokens, {}
    prefix_pos = None
    for k, v in model.state_dict().items():
        if k == "patch_embed.proj.weight":  # conv (dim, C, p, q) -> linear (dim, p*q*C), channel fastest
            sd["embeds.proj.weight"] = v.permute(0, 2, 3, 1).reshape(v.shape[0], -1)
        elif k.startswith("patch_embed.proj."):
            sd["embeds.proj." + k[len("patch_embed.proj."):]] = v
        elif k == "pos_embed.weight":  # (1, P + h*w, dim) -> (1, h, w, dim) + prefix rows
            prefix_pos = v[0, :P]
            sd["embeds.pos_embed"] = v[:, P:].reshape(1, *model.grid_size, v.shape[-1])
        elif k in ("pos_embed.row", "pos_embed.col"):
            sd["embeds.pos_embed_y" if k.endswith("row") else "embeds.pos_embed_x"] = v[None]
        elif k in ("cls_token", "reg_token"):
            sd["embeds." + k] = v.clone()
        else:
            sd[k] = v
    if prefix_pos is not None and P:
        rows = iter(prefix_pos)
        for k in ("embeds.cls_token", "embeds.reg_token"):
            if k in sd:
                n = sd[k].shape[1]
                sd[k] = sd[k] + torch.stack([next(rows) for _ in range(n)])[None]
    if tm.embeds.proj.weight.ndim == 4:  # a conv projection in timm: the conv weight as it is
        sd["embeds.proj.weight"] = model.patch_embed.proj.weight.detach().clone()
    for k, v in tm.state_dict().items():  # timm's NaFlexVit entry points keep a LayerScale whatever
        if k.endswith((".ls1.gamma", ".ls2.gamma")) and k not in sd:  # init_values says: scale 1 is none
            sd[k] = torch.ones_like(v)
    tm.load_state_dict(sd)
    return tm.train(model.training)

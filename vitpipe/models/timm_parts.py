"""What the timm converters share: reading a timm module's settings (activation, norms, attention
pooling) as vitpipe ViT options, and loading a converted state dict with a one-line refusal."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitpipe.models.vit import ViT


def act_name(act: nn.Module) -> str | None:
    """vitpipe's ``mlp_act`` for a timm MLP activation module; None when vitpipe has no equivalent."""
    if isinstance(act, nn.GELU):
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    return {"GELU": "gelu", "GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}.get(type(act).__name__)


def norm_settings(tm: nn.Module) -> tuple[float, list[str]]:
    """(the one LayerNorm eps of ``tm``, what vitpipe cannot express about its norms)."""
    bad, eps = set(), set()
    for m in tm.modules():
        name = type(m).__name__
        if isinstance(m, nn.LayerNorm):
            eps.add(m.eps)
            if not m.elementwise_affine or m.bias is None:
                bad.add("LayerNorm without affine weight and bias")
        elif "Norm" in name:
            bad.add(f"norm layer {name} (vitpipe's ViT uses LayerNorm)")
    if len(eps) > 1:
        bad.add(f"LayerNorms with different eps ({', '.join(map(str, sorted(eps)))})")
    return (eps.pop() if len(eps) == 1 else 1e-6), sorted(bad)


def attn_pool_kwargs(pool: nn.Module, dim: int, unsupported: list[str]) -> dict:
    """ViT kwargs (``pool_num_heads``, ``pool_mlp_ratio``) for timm's attention pooling module; what vitpipe's
    ``pool='map'`` (timm's AttentionPoolLatent: one latent, no positions, no qk-norm) lacks goes to
    ``unsupported``."""
    if type(pool).__name__ != "AttentionPoolLatent":
        unsupported.append(f"attention pooling {type(pool).__name__}")
        return {}
    mlp = getattr(pool, "mlp", None)
    checks = [(pool.latent_len != 1, f"attention pooling with {pool.latent_len} latents"),
              (pool.pos_embed is not None, "attention pooling with its own positions"),
              (not isinstance(pool.q_norm, nn.Identity), "attention pooling with qk_norm"),
              (pool.pool != "token", f"attention pooling pool_type={pool.pool!r}"),
              (mlp is None, "attention pooling without its MLP"),
              (pool.latent.shape[-1] != dim, "attention pooling with its own latent width")]
    unsupported += [what for bad, what in checks if bad]
    return {} if mlp is None else {"pool_num_heads": pool.num_heads, "pool_mlp_ratio": mlp.fc1.out_features / dim}


def load_converted(model: nn.Module, sd: dict[str, Tensor], source: nn.Module) -> nn.Module:
    """``model`` with ``sd`` loaded, in ``source``'s train/eval mode; a one-line ValueError naming the keys that
    do not map, or the shapes that differ, instead of torch's multi-line dump (the last guard: the kwargs checks
    should have refused such a model)."""
    if "patch_embed.proj.bias" not in sd:  # timm drops it with pre_norm (CLIP): a zero bias is the same map
        sd["patch_embed.proj.bias"] = torch.zeros_like(model.patch_embed.proj.bias)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a size mismatch: torch's message is many lines
        raise ValueError(f"timm {type(source).__name__} has parameter shapes vitpipe's ViT does not build: "
                         f"{str(e).splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise ValueError(f"timm {type(source).__name__} has parameters vitpipe's ViT does not map: "
                         f"unexpected {unexpected[:4]}, missing {missing[:4]}")
    return model.train(source.training)


def zoo_parts(model: nn.Module, *, can: tuple[str, ...] = ()) -> list[str]:
    """The ViT options met in timm's zoo (``norm_eps``, ``pre_norm``, ``final_norm=False``, ``mlp_act``,
    ``pool='map'``, ``fc_norm``, ``mlp='swiglu'``, ``mlp_norm``, ``attn_norm``, ``rope``, ...) that ``model``
    uses, each as the phrase an export refusal names; ``can`` lists the keys the export target writes back."""
    if not isinstance(model, ViT):
        return []
    blk = model.blocks[0]
    fc_by_pool = (model.pool == "mean") == (not isinstance(model.fc_norm, nn.Identity))
    hidden = getattr(blk.mlp, "fc1", blk.mlp.fc2).out_features  # (SwiGLU is refused on its own)
    own_pool = model.pool == "map" and (model.attn_pool.num_heads != blk.attn.num_heads
                                        or model.attn_pool.mlp.fc1.out_features != hidden)
    checks = [("eps", model.norm_eps != 1e-6, f"LayerNorm eps {model.norm_eps} (norm_eps; timm's kwargs keep 1e-6)"),
              ("pre_norm", model.pre_norm, "pre_norm"),
              ("final_norm", not model.final_norm, "final_norm=False"),
              ("mlp_act", model.mlp_act != "gelu" and type(blk.mlp).__name__ == "Mlp", f"mlp_act={model.mlp_act!r}"),
              ("map", model.pool == "map", "pool='map' (attention pooling)"),
              ("pool_size", own_pool, "attention pooling with its own heads or MLP width (pool_num_heads, pool_mlp_ratio)"),
              ("pool_include_prefix", model.pool_include_prefix, "pool_include_prefix"),
              ("fc_norm", model.final_norm and not fc_by_pool, "fc_norm other than by pool"),
              ("swiglu", type(blk.mlp).__name__ != "Mlp", "mlp='swiglu'"),
              ("mlp_norm", not isinstance(getattr(blk.mlp, "norm", nn.Identity()), nn.Identity), "mlp_norm"),
              ("attn_norm", not isinstance(blk.attn.norm, nn.Identity), "attn_norm"),
              ("rope", model.rope is not None, "rope=True (rotary positions besides pos_embed)")]
    return [what for key, bad, what in checks if bad and key not in can]

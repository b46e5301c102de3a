"""Attention rollout, gradient rollout and raw attention / cross-attention maps.

Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in
Transformers", arXiv:2005.00928): a token's output is a mix of its residual
stream and the values it attends to, so each layer is modelled as
``A = 0.5 * W + 0.5 * I`` (rows renormalised) and the layers are chained,
``R = A_L @ ... @ A_1``. Row ``q`` of ``R`` says how much each input token
flows into output token ``q``.

Gradient rollout weighs each head's attention by the gradient of the chosen
logit (Chefer, Gur & Wolf 2021, "Generic Attention-model Explainability",
arXiv:2103.15679): ``W = mean_heads((dy/dA * A)^+)``, then the same recursion.

Where this differs from the widely copied vit-explain code, on purpose:
- rows are renormalised with ``sum(-1, keepdim=True)``; ``a / a.sum(dim=-1)``
  divides *columns* by the row sums (it only runs because batch size is 1);
- ``discard_ratio`` drops the lowest weights of each row among the patch
  columns; vit-explain ranks the flattened matrix, of batch item 0 only, and
  "protects the class token" by sparing the single entry (0, 0) rather than the
  class column. Prefix columns (class and register tokens) are never
  discarded: they are attention sinks, and zeroing them redistributes their
  mass onto patches arbitrarily;
- the caller's attention tensors are never modified in place;
- the query may be the class token or, for mean-pooled models, the mean over
  patch queries; prefix tokens other than the class token (registers) are
  skipped; grids may be non-square.
- attentions are taken from ``forward_features(x, return_attn=True)``, not from
  hooks, which record nothing once the fused SDPA kernel is on.

The returned maps are raw rollout weights (not rescaled); ``viz.overlay``
min-max normalises them for display.

One file of a little over 400 lines on purpose: the three readings (rollout, gradient rollout, raw and
cross-attention maps) share the input checks, head fusion, discard rule and recursion above, and the
differences from vit-explain listed here are read against all of them at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from vitpipe.config.options import FUSIONS, check_rollout_settings
from vitpipe.errors import ConfigError
from vitpipe.nn.modes import eval_mode

QUERIES = ("cls", "mean")


# --------------------------------------------------------------------------- checks


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _resolve_query(query: str | None, num_prefix_tokens: int) -> str:
    """``None`` means: the class token if there is one, else the mean over patch queries."""
    if query is None:
        return "cls" if num_prefix_tokens >= 1 else "mean"
    _check_choice("query", query, QUERIES)
    if query == "cls" and num_prefix_tokens < 1:
        raise ConfigError(
            "query='cls' needs a class token but num_prefix_tokens=0; use query='mean' "
            "(average over patch queries) for models without a class token"
        )
    return query


def _resolve_grid(num_patches: int, grid_size) -> tuple[int, int]:
    if grid_size is None:
        side = math.isqrt(num_patches)
        if side * side != num_patches:
            raise ConfigError(
                f"cannot infer a square grid from {num_patches} patch tokens; pass grid_size=(h, w) "
                "with h * w == the patch count"
            )
        return side, side
    if isinstance(grid_size, int):
        grid_size = (grid_size, grid_size)
    h, w = (int(s) for s in grid_size)
    if h * w != num_patches:
        raise ConfigError(
            f"grid_size={(h, w)} holds {h * w} patches but the attention has {num_patches} patch tokens"
        )
    return h, w


def _check_attentions(attentions: Sequence[Tensor], num_prefix_tokens: int) -> tuple[int, int, int]:
    """Validate a list of per-layer (B, heads, N, N) maps; return (B, heads, N)."""
    if isinstance(attentions, Tensor) or len(attentions) == 0:
        raise ConfigError("attentions must be a non-empty list of per-layer (B, heads, N, N) tensors")
    shape = attentions[0].shape
    if len(shape) != 4 or shape[-1] != shape[-2]:
        raise ConfigError(f"each attention must be (B, heads, N, N), got {tuple(shape)}")
    for i, a in enumerate(attentions):
        if a.shape != shape:
            raise ConfigError(f"attention {i} has shape {tuple(a.shape)}, layer 0 has {tuple(shape)}")
    if not 0 <= num_prefix_tokens < shape[-1]:
        raise ConfigError(
            f"num_prefix_tokens={num_prefix_tokens} is not valid for {shape[-1]} tokens; "
            f"use 0 <= num_prefix_tokens < {shape[-1]}"
        )
    return shape[0], shape[1], shape[-1]


# --------------------------------------------------------------------------- core


def _fuse(x: Tensor, how: str, dim: int) -> Tensor:
    if how == "mean":
        return x.mean(dim)
    return x.amax(dim) if how == "max" else x.amin(dim)


def _float(x: Tensor) -> Tensor:
    # bf16/fp16 attentions (autocast) lose too much in a depth-long product of matrices
    return x.detach().double() if x.dtype == torch.float64 else x.detach().float()


def discard_lowest(weights: Tensor, discard_ratio: float, num_prefix_tokens: int) -> Tensor:
    """Zero the lowest ``floor(discard_ratio * P)`` patch weights of every row.

    weights: (B, N, N) head-fused attention, N = num_prefix_tokens + P. Prefix
    columns are kept (see module docstring). Returns a new tensor.
    """
    num_patches = weights.shape[-1] - num_prefix_tokens
    k = int(discard_ratio * num_patches)
    if k == 0:
        return weights
    patches = weights[..., num_prefix_tokens:]  # (B, N, P)
    lowest = patches.topk(k, dim=-1, largest=False).indices  # (B, N, k)
    keep = torch.ones_like(patches, dtype=torch.bool).scatter_(-1, lowest, False)
    return torch.cat([weights[..., :num_prefix_tokens], patches * keep], dim=-1)


def rollout_matrix(fused: Sequence[Tensor], *, discard_ratio: float = 0.0, num_prefix_tokens: int = 1) -> Tensor:
    """Chain head-fused per-layer weights (B, N, N), first layer first, into R = A_L ... A_1 (B, N, N)."""
    n = fused[0].shape[-1]
    eye = torch.eye(n, dtype=fused[0].dtype, device=fused[0].device)
    result = eye.expand_as(fused[0])
    for w in fused:
        w = discard_lowest(w, discard_ratio, num_prefix_tokens)
        # residual connection: half the output is the token itself (Abnar & Zuidema, sec. 3)
        a = 0.5 * w + 0.5 * eye
        a = a / a.sum(dim=-1, keepdim=True)  # rows, not columns
        result = a @ result  # R_l = A_l @ R_{l-1}
    return result


def _read_out(result: Tensor, num_prefix_tokens: int, query: str) -> Tensor:
    """Row(s) of the query over the patch columns: (B, N, N) -> (B, P)."""
    if query == "cls":
        return result[:, 0, num_prefix_tokens:]  # timm order: class token first, registers after it
    # mean-pooled models predict from the average of the patch tokens
    return result[:, num_prefix_tokens:, num_prefix_tokens:].mean(dim=1)


def attention_rollout(
    attentions: Sequence[Tensor],
    *,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
    query: str | None = None,
) -> Tensor:
    """Attention rollout maps on the patch grid.

    attentions: per-layer (B, heads, N, N) softmax weights, first layer first, as
        returned by ``ViT.forward_features(x, return_attn=True)``.
    head_fusion: "mean" | "max" | "min" over heads.
    discard_ratio: fraction of the lowest patch weights dropped per row, in [0, 1).
    num_prefix_tokens: class + register tokens at the start of the sequence.
    grid_size: (h, w) patch grid; None infers a square grid.
    query: "cls" (row of the class token) or "mean" (mean over patch-query rows,
        for mean-pooled models); None picks "cls" when num_prefix_tokens >= 1.
    Returns (B, h, w) float.
    """
    check_rollout_settings(head_fusion=head_fusion, discard_ratio=discard_ratio)
    _, _, n = _check_attentions(attentions, num_prefix_tokens)
    query = _resolve_query(query, num_prefix_tokens)
    h, w = _resolve_grid(n - num_prefix_tokens, grid_size)
    fused = [_fuse(_float(a), head_fusion, dim=1) for a in attentions]  # L x (B, N, N)
    with torch.no_grad():
        result = rollout_matrix(fused, discard_ratio=discard_ratio, num_prefix_tokens=num_prefix_tokens)
        maps = _read_out(result, num_prefix_tokens, query)  # (B, P)
    return maps.reshape(-1, h, w)  # (B, h, w), row-major like the patch sequence


def attention_maps(
    attentions: Sequence[Tensor],
    *,
    layer: int | None = None,
    num_prefix_tokens: int = 1,
    grid_size: tuple[int, int] | None = None,
    query: str | None = None,
) -> Tensor:
    """Raw per-layer, per-head attention of the query over the patch grid.

    layer: one layer index (negative counts from the end) or None for all.
    Returns (B, L or 1, heads, h, w).
    """
    _, _, n = _check_attentions(attentions, num_prefix_tokens)
    query = _resolve_query(query, num_prefix_tokens)
    h, w = _resolve_grid(n - num_prefix_tokens, grid_size)
    if layer is not None:
        if not -len(attentions) <= layer < len(attentions):
            raise ConfigError(
                f"layer={layer} is out of range for {len(attentions)} layers; "
                f"use -{len(attentions)} <= layer < {len(attentions)} or None"
            )
        attentions = [attentions[layer]]
    attn = torch.stack([_float(a) for a in attentions], dim=1)  # (B, L, heads, N, N)
    if query == "cls":
        rows = attn[..., 0, num_prefix_tokens:]  # (B, L, heads, P)
    else:
        rows = attn[..., num_prefix_tokens:, num_prefix_tokens:].mean(dim=-2)  # (B, L, heads, P)
    return rows.reshape(*rows.shape[:3], h, w)  # (B, L, heads, h, w)


def cross_attention_maps(
    cross_attn,
    grid_size: tuple[int, int] | None,
    *,
    num_prefix_tokens: int = 0,
    layer_fusion: str | int = "mean",
    head_fusion: str = "mean",
) -> Tensor:
    """Where each generated word looked in the image (captioner cross-attention).

    cross_attn: (B, layers, heads, T, M) weights of the T text queries over the
        M image tokens (or a list of per-layer (B, heads, T, M) tensors).
    num_prefix_tokens: image-side prefix tokens (class/registers) to skip.
    head_fusion: "mean" | "max" | "min", applied first, per layer.
    layer_fusion: "mean" | "max" | "min" | "last", or a layer index.
    Returns (B, T, h, w).
    """
    check_rollout_settings(head_fusion=head_fusion)
    if not isinstance(layer_fusion, int):
        _check_choice("layer_fusion", layer_fusion, (*FUSIONS, "last"))
    if not isinstance(cross_attn, Tensor):
        cross_attn = torch.stack(list(cross_attn), dim=1)  # (B, layers, heads, T, M)
    if cross_attn.dim() != 5:
        raise ConfigError(f"cross_attn must be (B, layers, heads, T, M), got {tuple(cross_attn.shape)}")
    num_layers, m = cross_attn.shape[1], cross_attn.shape[-1]
    if not 0 <= num_prefix_tokens < m:
        raise ConfigError(f"num_prefix_tokens={num_prefix_tokens} is not valid for {m} image tokens")
    h, w = _resolve_grid(m - num_prefix_tokens, grid_size)
    x = _fuse(_float(cross_attn), head_fusion, dim=2)  # (B, layers, T, M)
    if isinstance(layer_fusion, int) or layer_fusion == "last":
        index = -1 if layer_fusion == "last" else layer_fusion
        if not -num_layers <= index < num_layers:
            raise ConfigError(f"layer_fusion={layer_fusion} is out of range for {num_layers} layers")
        x = x[:, index]  # (B, T, M)
    else:
        x = _fuse(x, layer_fusion, dim=1)  # (B, T, M)
    x = x[..., num_prefix_tokens:]  # (B, T, P)
    return x.reshape(*x.shape[:2], h, w)  # (B, T, h, w)


# --------------------------------------------------------------------------- model helpers




def _check_no_merging(model: nn.Module) -> None:
    """Rollout multiplies (N, N) maps layer by layer: a ToMe model (``tome_r``) has fewer tokens each layer."""
    if getattr(model, "tome_r", 0) > 0:
        raise ConfigError("attention rollout with model.tome_r>0: merged tokens change the token count per layer; "
                         "use tome_r=0 for rollout")


def _model_readout(model: nn.Module, x: Tensor, num_prefix_tokens, grid_size, query) -> tuple:
    """(num_prefix_tokens, grid_size, query) from the model where the caller left them None."""
    if num_prefix_tokens is None:
        num_prefix_tokens = model.num_prefix_tokens
    if grid_size is None:
        patch = getattr(model, "patch_size", None)
        if patch is not None:  # the grid of this input, which may differ from the built img_size
            ph, pw = (patch, patch) if isinstance(patch, int) else patch
            grid_size = (x.shape[-2] // ph, x.shape[-1] // pw)
        else:
            grid_size = tuple(model.grid_size)
    if query is None:
        pool = getattr(model, "pool", "cls")
        query = "cls" if pool == "cls" and num_prefix_tokens >= 1 else "mean"
    return num_prefix_tokens, grid_size, query


def rollout_for_model(
    model: nn.Module, x: Tensor, *, num_prefix_tokens=None, grid_size=None, query=None, **kw
) -> Tensor:
    """``attention_rollout`` of ``model`` on images x (B, C, H, W) -> (B, h, w).

    Runs in eval mode (dropout off), without gradients. num_prefix_tokens,
    grid_size and query (class token or mean, after ``model.pool``) come from
    the model unless given; other ``kw`` (head_fusion, discard_ratio) go to
    ``attention_rollout``.
    """
    _check_no_merging(model)
    prefix, grid, query = _model_readout(model, x, num_prefix_tokens, grid_size, query)
    with torch.no_grad(), eval_mode(model):
        _, attentions = model.forward_features(x, return_attn=True)
    return attention_rollout(attentions, num_prefix_tokens=prefix, grid_size=grid, query=query, **kw)


def naflex_rollout(
    attentions: Sequence[Tensor], batch: dict, *, num_prefix_tokens: int = 1, query: str | None = None, **kw
) -> list[Tensor]:
    """``attention_rollout`` of a NaFlex patch-dict batch: one (h_i, w_i) map per image, on its own grid.

    attentions: per-layer (B, heads, P + N, P + N) from ``forward_features(batch, return_attn=True)``;
    batch: the patch dict (``patch_coord``, ``patch_valid``). Each image keeps its prefix and valid
    tokens only: padding keys got zero weight (masked), so the rows are the image's own, and the map
    equals the one of the image alone. Values are placed by ``patch_coord``, whatever the token order.
    """
    from vitpipe.nn.naflex import grid_sizes

    _check_attentions(attentions, num_prefix_tokens)
    coord, valid = batch["patch_coord"].long(), batch["patch_valid"].bool()
    sizes = grid_sizes(coord * valid[..., None], valid).tolist()  # (B, 2) as lists
    maps = []
    for i, (h, w) in enumerate(sizes):
        keep = valid[i].nonzero().flatten()  # (n_i,) valid patch positions
        idx = torch.cat([torch.arange(num_prefix_tokens, device=keep.device), keep + num_prefix_tokens])
        own = [a[i : i + 1][:, :, idx][..., idx] for a in attentions]  # L x (1, heads, P + n_i, P + n_i)
        flat = attention_rollout(own, num_prefix_tokens=num_prefix_tokens, grid_size=(1, len(keep)), query=query,
                                 **kw)[0, 0]  # (n_i,) in token order
        grid = flat.new_zeros(h, w)
        grid[coord[i, keep, 0], coord[i, keep, 1]] = flat
        maps.append(grid)  # (h_i, w_i)
    return maps


def naflex_rollout_for_model(model: nn.Module, batch: dict, *, query: str | None = None, **kw) -> list[Tensor]:
    """``naflex_rollout`` of ``model`` on a patch dict: eval mode, no gradients; the query after ``model.pool``."""
    _check_no_merging(model)
    prefix = model.num_prefix_tokens
    if query is None:
        query = "cls" if getattr(model, "pool", "cls") == "cls" and prefix >= 1 else "mean"
    with torch.no_grad(), eval_mode(model):
        _, attentions = model.forward_features(batch, return_attn=True)
    return naflex_rollout(attentions, batch, num_prefix_tokens=prefix, query=query, **kw)


def _targets(logits: Tensor, target) -> Tensor:
    batch, num_classes = logits.shape
    if target is None:
        return logits.argmax(dim=-1)
    target = torch.as_tensor(target, device=logits.device).long().reshape(-1)
    if target.numel() == 1:
        target = target.expand(batch)
    if target.numel() != batch:
        raise ConfigError(
            f"target has {target.numel()} entries for a batch of {batch}; give one class or one per image"
        )
    if (target < 0).any() or (target >= num_classes).any():
        raise ConfigError(f"target={target.tolist()} is out of range; classes are 0..{num_classes - 1}")
    return target


def gradient_weighted(attention: Tensor, grad: Tensor | None) -> Tensor:
    """Head fusion of gradient rollout: mean_h (grad * A)^+ , (B, heads, N, N) -> (B, N, N).

    The positive part is taken per head, before the mean (Chefer et al. 2021, eq. 5), so a
    head that argues against the class cannot cancel one that argues for it.
    """
    if grad is None:  # the attention did not reach the logit
        return torch.zeros_like(_float(attention)).mean(dim=1)
    return (_float(grad) * _float(attention)).clamp(min=0).mean(dim=1)


def gradient_rollout(
    model: nn.Module,
    x: Tensor,
    target=None,
    *,
    discard_ratio: float = 0.0,
    num_prefix_tokens: int | None = None,
    grid_size: tuple[int, int] | None = None,
    query: str | None = None,
) -> Tensor:
    """Gradient-weighted attention rollout (Chefer et al. 2021) -> (B, h, w).

    target: None (the predicted class), one class for all images, or one per image.
    Per layer, heads are fused by ``gradient_weighted`` and rows rescaled to sum to 1 (so
    the map does not depend on the logits' scale); then the rollout recursion. Eval mode. Parameters are not
    touched: the input gets requires_grad on a detached alias, so the attention
    stays in the graph even for a frozen model, and only d logit / d attention
    is computed (no ``.grad`` is written). num_prefix_tokens, grid_size and
    query come from the model unless given, as in ``rollout_for_model``.
    """
    check_rollout_settings(discard_ratio=discard_ratio)
    _check_no_merging(model)
    prefix, grid, query = _model_readout(model, x, num_prefix_tokens, grid_size, query)
    with torch.enable_grad(), eval_mode(model):
        x = x.detach().requires_grad_(True)
        tokens, attentions = model.forward_features(x, return_attn=True)
        _, _, n = _check_attentions(attentions, prefix)
        query = _resolve_query(query, prefix)
        h, w = _resolve_grid(n - prefix, grid)
        logits = model.forward_head(tokens)  # (B, classes)
        target = _targets(logits, target)
        # images are independent (no batch statistics in a ViT), so the gradient of the
        # sum is each image's own gradient
        chosen = logits.gather(1, target[:, None]).sum()
        grads = torch.autograd.grad(chosen, list(attentions), allow_unused=True)
    fused = [gradient_weighted(a, g) for a, g in zip(attentions, grads)]  # L x (B, N, N)
    # A = 0.5 W + 0.5 I assumes rows of W sum to 1, as attention rows do; grad * A rows sum to
    # whatever the logit scale makes them, so without this the residual share (and the map)
    # would change with a temperature on the logits. Rows with no positive mass stay zero.
    fused = [w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny) for w in fused]
    result = rollout_matrix(fused, discard_ratio=discard_ratio, num_prefix_tokens=prefix)
    return _read_out(result, prefix, query).reshape(-1, h, w)  # (B, h, w)

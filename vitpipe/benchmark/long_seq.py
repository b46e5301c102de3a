"""``--only long_seq``: attention for long sequences. A small stack of ``EncoderBlock``s at 1,024, 2,304 and
4,096 patches (+ one class token), five ways side by side:

- ``sdpa``: dense ``F.scaled_dot_product_attention`` (the baseline every ratio divides by);
- ``explicit``: the explicit softmax path (``need_weights=True``), what rollout and gradient rollout run;
- ``checkpoint``: dense SDPA with ``torch.utils.checkpoint`` around every block (activations recomputed
  in the backward pass, Chen et al. 2016);
- ``local_sdpa``: the local + global pattern (``vitpipe.nn.patterns``) as a boolean mask through SDPA;
- ``local_flex``: the same pattern as a flex ``BlockMask`` through ``flex_attention`` (compiled).

Train steps are forward + backward (no optimizer: the attention is what differs); infer steps are a
forward under ``no_grad``. Where flex cannot run a phase on the device (no backward on a CPU in torch
2.14), the contender is listed as unavailable with torch's reason. The settings that matter here are
``--device``, ``--precision``, ``--steps``, ``--warmup`` and ``--repeats``; the sizes are this module's
(batch 1, not ``--batch-size``), so one run fits a CPU.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from vitpipe.benchmark.common import StepMemory, interleave_steps, paired_ratio, summarize
from vitpipe.benchmark.config import BenchConfig
from vitpipe.nn.blocks import EncoderBlock
from vitpipe.nn.patterns import dense_mask, flex_support, local_global_mask

TOKENS = (1024, 2304, 4096)  # patches: 32^2, 48^2, 64^2
METHODS = ("sdpa", "explicit", "checkpoint", "local_sdpa", "local_flex")
BASELINE = "sdpa"


def compare_long_seq(
    cfg: BenchConfig,
    *,
    tokens: tuple[int, ...] = TOKENS,
    dim: int = 192,
    heads: int = 3,
    depth: int = 2,
    batch: int = 1,
    window: int = 3,
    global_stride: int = 0,
    num_prefix: int = 1,
    flex: bool | None = None,
) -> dict:
    """Step time and peak step memory of each method at each square grid of ``tokens`` patches.

    Contenders are ``<method>/<patches>`` with ``train`` and ``infer`` phases (no ``infer`` for
    ``checkpoint``: without a backward pass it is dense SDPA). ``flex``: None = time ``local_flex``
    where flex compiles on the device, False = leave it out. Ratios are against ``sdpa`` at the same
    size: time (medians, and the paired median of interleaved steps) and peak step memory.
    """
    support = flex_support(cfg.device)
    use_flex = support["compiled"] if flex is None else flex
    torch.manual_seed(cfg.seed)
    blocks = torch.nn.ModuleList(EncoderBlock(dim, heads) for _ in range(depth)).to(cfg.device)
    contenders, ratios, unavailable, masks = {}, {}, {}, {}
    for n in tokens:
        side = round(n**0.5)
        if side * side != n:
            raise ValueError(f"tokens={n}: expected a square number of patches (a side x side grid)")
        grid = (side, side)
        x = torch.randn(batch, num_prefix + n, dim, generator=torch.Generator().manual_seed(cfg.seed + 1)).to(cfg.device)
        kw = dict(window=window, global_stride=global_stride, device=cfg.device)
        pattern = {"local_sdpa": local_global_mask(grid, num_prefix, backend="sdpa", **kw)}
        if use_flex:
            pattern["local_flex"] = local_global_mask(grid, num_prefix, backend="flex", **kw)
        masks[n] = _mask_info(pattern["local_sdpa"], pattern.get("local_flex"))
        for phase in ("train", "infer"):
            steps = {}
            for method in METHODS:
                name = f"{method}/{n}"
                if method == "local_flex" and not use_flex:
                    unavailable[name] = "not asked (flex=False)" if flex is False else support["why"]
                elif method == "local_flex" and phase == "train" and not support["backward"]:
                    unavailable[f"{name} train"] = support["why"]
                elif not (method == "checkpoint" and phase == "infer"):
                    steps[name] = _step(blocks, x, method, pattern.get(method), phase, cfg)
            times = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats, device=cfg.device)
            for name, step in steps.items():
                with StepMemory(cfg.device) as mem:
                    step()
                contenders.setdefault(name, {})[phase] = {
                    **summarize(times[name], batch),
                    "tokens": num_prefix + n,
                    "memory": mem.as_dict(),
                }
            base = f"{BASELINE}/{n}"
            for name in steps:
                if name == base:
                    continue
                a, b = contenders[name][phase], contenders[base][phase]
                method = name.split("/")[0]
                ratios[f"{phase} time {method}/{BASELINE} @{n}"] = a["step_s"] / b["step_s"]
                ratios[f"{phase} time {method}/{BASELINE} @{n} (paired)"] = paired_ratio(times[name], times[base])
                ratios[f"{phase} peak mem {method}/{BASELINE} @{n}"] = (
                    a["memory"]["peak_step_bytes"] / b["memory"]["peak_step_bytes"]
                )
    return {
        "contenders": contenders,
        "ratios": ratios,
        "unavailable": unavailable,
        "masks": masks,
        "setting": {
            "dim": dim,
            "heads": heads,
            "depth": depth,
            "batch": batch,
            "window": window,
            "global_stride": global_stride,
            "num_prefix": num_prefix,
            "tokens": list(tokens),
            "flex": support,
        },
    }


def _step(blocks: torch.nn.ModuleList, x: torch.Tensor, method: str, mask, phase: str, cfg: BenchConfig):
    """One forward (``infer``) or forward + backward (``train``) of ``blocks`` the ``method``'s way."""

    def forward() -> torch.Tensor:
        y = x
        for blk in blocks:
            if method == "explicit":
                y = blk(y, need_weights=True)[0]  # (B, N, dim); the (B, heads, N, N) weights are built and kept
            elif method == "checkpoint" and torch.is_grad_enabled():
                y = checkpoint(blk, y, use_reentrant=False)
            else:
                y = blk(y, attn_mask=mask)
        return y

    def step() -> None:
        if phase == "infer":
            with torch.no_grad(), cfg.autocast():
                forward()
            return
        with cfg.autocast():
            loss = forward().float().pow(2).mean()
        loss.backward()
        blocks.zero_grad(set_to_none=True)

    blocks.train(phase == "train")
    return step


def _mask_info(bool_mask: torch.Tensor, block_mask) -> dict:
    """How sparse the pattern is: kept (query, key) pairs, and the bytes each form of the mask holds."""
    info = {"kept_fraction": bool_mask.float().mean().item(), "bool_bytes": bool_mask.numel() * bool_mask.element_size()}
    if block_mask is not None:
        assert torch.equal(dense_mask(block_mask), bool_mask)  # one mask_mod: the two forms cannot differ
        tensors = [t for t in block_mask.as_tuple(flatten=True) if isinstance(t, torch.Tensor)]
        info |= {
            "blockmask_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "block_sparsity": block_mask.sparsity() / 100,
        }
    return info


def markdown(res: dict) -> str:
    """The comparison as a markdown table: one row per size and method, train and infer side by side,
    each with its ratio to dense SDPA (docs/performance.md)."""
    c, r, s = res["contenders"], res["ratios"], res["setting"]
    lines = [
        "| patches (+prefix) | method | train ms | x sdpa | train peak MiB | x sdpa | infer ms | x sdpa "
        "| infer peak MiB | x sdpa |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in s["tokens"]:
        for method in METHODS:
            cells = []
            for phase in ("train", "infer"):
                fig = c.get(f"{method}/{n}", {}).get(phase)
                if fig is None:
                    cells += ["n/a"] * 4
                    continue
                peak = fig["memory"]["peak_step_bytes"]
                base = method == BASELINE
                cells += [
                    f"{1e3 * fig['step_s']:.1f}",
                    "1" if base else f"{r[f'{phase} time {method}/{BASELINE} @{n}']:.2f}",
                    f"{peak / 2**20:.1f}",
                    "1" if base else f"{r[f'{phase} peak mem {method}/{BASELINE} @{n}']:.2f}",
                ]
            lines.append(f"| {n} (+{s['num_prefix']}) | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

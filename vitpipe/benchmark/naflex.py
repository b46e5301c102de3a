"""``--only naflex``: patch-dict (NaFlex) input, mixed-aspect padded batches against the fixed square
path and against timm's NaFlexVit with the same weights."""

from __future__ import annotations

import copy
import math

import timm
import torch

from vitpipe.benchmark.common import infer_step, interleave_steps, paired_ratio, summarize, train_step
from vitpipe.benchmark.config import BenchConfig
from vitpipe.models.registry import VARIANTS
from vitpipe.models.timm_compat import from_timm
from vitpipe.nn.naflex import pad_batch, patchify_image


def naflex_pair(cfg: BenchConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(vitpipe ViT, timm NaFlexVit) of the variant with the same weights (``from_timm``), on
    ``cfg.device``: learned positions resampled aspect-preserving, average pooling (timm's
    ``naflexvit_base_patch16_par_gap`` at the variant's width, depth, heads, patch and grid)."""
    torch.manual_seed(cfg.seed)
    v = VARIANTS[cfg.variant]
    grid = cfg.size // v["patch_size"]
    tm = timm.create_model("naflexvit_base_patch16_par_gap", pretrained=False, embed_dim=v["dim"], depth=v["depth"],
                           num_heads=v["num_heads"], patch_size=v["patch_size"], num_classes=cfg.num_classes,
                           pos_embed_grid_size=(grid, grid))
    return from_timm(tm).to(cfg.device), tm.to(cfg.device)


def naflex_batches(cfg: BenchConfig, *, seed: int = 1) -> dict:
    """The inputs of ``compare_naflex``: ``square`` (B, 3, S, S) images, the same images as a patch dict
    (``square_dict``, full grid, no padding), and ``mixed``: images of aspect W/H log-uniform in [1/3, 3],
    each at the largest grid of at most (S/p)^2 patches, padded to that length, as many images as
    it takes to hold at least the square batch's B (S/p)^2 valid tokens; labels for each."""
    g = torch.Generator().manual_seed(seed)
    patch = VARIANTS[cfg.variant]["patch_size"]
    seq = (cfg.size // patch) ** 2
    square = torch.randn(cfg.batch_size, 3, cfg.size, cfg.size, generator=g)
    items, valid = [], 0
    while valid < cfg.batch_size * seq:
        aspect = math.exp((2 * torch.rand((), generator=g).item() - 1) * math.log(3))  # W / H
        h = max(1, round(cfg.size / math.sqrt(aspect)))
        items.append(patchify_image(torch.randn(3, h, max(1, round(h * aspect)), generator=g), patch, seq))
        valid += len(items[-1]["patches"])

    def labels(n):
        return torch.randint(0, cfg.num_classes, (n,), generator=g).to(cfg.device)

    def dev(d):
        return {k: v.to(cfg.device) for k, v in d.items()}

    return {"square": (square.to(cfg.device), labels(cfg.batch_size)),
            "square_dict": (dev(pad_batch([patchify_image(im, patch, seq) for im in square])), labels(cfg.batch_size)),
            "mixed": (dev(pad_batch(items, seq_len=seq)), labels(len(items)))}


def compare_naflex(cfg: BenchConfig) -> dict:
    """Patch-dict (NaFlex) input: vitpipe's dict path on a padded batch of mixed-aspect images against its
    fixed tensor path on square images at (nearly) the same number of valid tokens (what padding and the
    per-image positions cost), and against timm's ``NaFlexVit`` on the same dict with the same weights
    (same math, logits checked). Inference and training steps (forward, cross-entropy, backward, AdamW)."""
    ours, theirs = naflex_pair(cfg)
    batches = naflex_batches(cfg)
    patch = VARIANTS[cfg.variant]["patch_size"]
    seq = (cfg.size // patch) ** 2
    tokens = {"square": cfg.batch_size * seq, "square_dict": cfg.batch_size * seq,
              "mixed": int(batches["mixed"][0]["patch_valid"].sum())}
    with torch.no_grad():  # parity on a copy with weights that matter (timm's LayerScale starts at 1e-5)
        a = copy.deepcopy(theirs).eval()
        for p in a.parameters():
            p.normal_(std=0.2, generator=torch.Generator(p.device).manual_seed(0))
        b = from_timm(a).eval()
        logit_diff = (b(batches["mixed"][0]) - a(batches["mixed"][0])).abs().max().item()
    # contender -> (network, input); vitpipe_* and timm_mixed share the mixed dict
    plan = {"vitpipe_fixed": (ours, "square"), "vitpipe_dict_sq": (ours, "square_dict"),
            "vitpipe_mixed": (ours, "mixed"), "timm_mixed": (theirs, "mixed")}
    contenders, times = {name: {} for name in plan}, {}
    for phase in ("train", "infer"):
        steps = {}
        for name, (net, key) in plan.items():
            x, y = batches[key]
            if phase == "train":  # its own optimizer per contender: the two vitpipe contenders share weights only
                opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
                steps[name] = train_step(net.train(), opt, x, y, cfg)
            else:
                steps[name] = infer_step(net.eval(), x, cfg)
        times[phase] = interleave_steps(steps, steps=cfg.steps, warmup=cfg.warmup, repeats=cfg.repeats,
                                        device=cfg.device)
        for name, (_, key) in plan.items():
            s = summarize(times[phase][name], len(batches[key][1]))
            contenders[name][phase] = {**s, "valid_tokens": tokens[key], "tokens_s": tokens[key] / s["step_s"]}
    ratios, t = {}, tokens
    for phase, key in (("train", "train_step"), ("infer", "infer")):
        c, tm = contenders, times[phase]
        ratios[f"{key} tokens/s mixed dict/fixed"] = c["vitpipe_mixed"][phase]["tokens_s"] / c["vitpipe_fixed"][phase]["tokens_s"]
        ratios[f"{key} tokens/s mixed dict/fixed (paired)"] = (
            paired_ratio(tm["vitpipe_fixed"], tm["vitpipe_mixed"]) * t["mixed"] / t["square"])
        ratios[f"{key} time square dict/tensor (paired)"] = paired_ratio(tm["vitpipe_dict_sq"], tm["vitpipe_fixed"])
        ratios[f"{key} time vitpipe/timm NaFlexVit"] = c["vitpipe_mixed"][phase]["step_s"] / c["timm_mixed"][phase]["step_s"]
        ratios[f"{key} time vitpipe/timm NaFlexVit (paired)"] = paired_ratio(tm["vitpipe_mixed"], tm["timm_mixed"])
    mixed = batches["mixed"][0]["patch_valid"]
    return {"contenders": contenders, "ratios": ratios, "max_abs_logit_diff": logit_diff,
            "mixed_batch": {"images": int(mixed.shape[0]), "seq_len": int(mixed.shape[1]), "valid_tokens": t["mixed"],
                            "padding_fraction": 1 - t["mixed"] / mixed.numel()},
            "square_batch": {"images": cfg.batch_size, "seq_len": seq, "valid_tokens": t["square"]}}

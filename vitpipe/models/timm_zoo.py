"""Which of timm's ViT-family entry points ``from_timm`` converts with exact logits: the zoo scan.

    python -m vitpipe.models.timm_zoo [--families 'vit_*,deit*,...'] [--max-params 120e6] [--filter GLOB]

For each entry point (``timm.list_models`` of the family patterns, at most ``--max-params`` parameters):
build it with random weights (``pretrained=False``, then every parameter perturbed by N(0, 0.02) so
that timm's zero biases and 1e-5 LayerScales do not hide a weight the conversion drops), convert with
``from_timm``, and compare the eval-mode logits on one random image at the entry point's own input size
(a NaFlexVit also gets one patch dict on another grid). Each lands in one of four rows:

- parity: max |ours - timm| <= ``TOLERANCE`` * max |timm logits| (1e-4 relative: float32 round-off is
  ~1e-6 of the logits' scale, a dropped or misplaced weight ~1e-2 or more);
- refused: ``from_timm`` raised ValueError/ConfigError with a one-line message naming the feature;
- mismatch: converted, logits differ by more;
- exception: anything else (a crash, or a refusal that is not one line). The goal is zero of these
  and zero mismatches.

Parameter counts come from building each model on the ``meta`` device (no memory, no init), so
entry points over the limit are never built for real.
"""

from __future__ import annotations

import argparse
import fnmatch
import time
from dataclasses import dataclass

import torch
from torch import nn

from vitpipe.errors import ConfigError

FAMILIES = ("vit_*", "deit*", "eva*", "beit*", "naflexvit*", "samvit*")
TOLERANCE = 1e-4  # relative to the largest logit magnitude
STATUSES = ("parity", "refused", "mismatch", "exception")


@dataclass
class ZooResult:
    name: str
    params: int
    status: str  # one of STATUSES
    detail: str  # the refusal / exception message, or the max abs difference
    seconds: float = 0.0


def count_params(name: str, **kwargs) -> int:
    """Parameters of timm entry point ``name`` (built on the meta device: no memory, no init)."""
    import timm

    with torch.device("meta"):
        tm = timm.create_model(name, pretrained=False, **kwargs)
    return sum(p.numel() for p in tm.parameters())


def entry_points(families=FAMILIES, *, max_params: float = 120e6, pattern: str | None = None) -> list[tuple[str, int]]:
    """(name, parameter count) of each timm entry point matching ``families`` (and glob ``pattern``),
    at most ``max_params`` parameters, sorted by name."""
    import timm

    names = sorted({n for f in families for n in timm.list_models(f)})
    if pattern:
        names = [n for n in names if fnmatch.fnmatch(n, pattern)]
    counted = [(n, count_params(n)) for n in names]
    return [(n, c) for n, c in counted if c <= max_params]


def random_timm(name: str, *, seed: int = 0, std: float = 0.02, **kwargs) -> nn.Module:
    """timm's ``name`` in eval mode with every parameter perturbed by N(0, std) (seeded)."""
    import timm

    torch.manual_seed(seed)
    tm = timm.create_model(name, pretrained=False, **kwargs).eval()
    with torch.no_grad():
        for p in tm.parameters():
            p.add_(torch.randn_like(p) * std)
    return tm


def sample_input(tm: nn.Module, *, seed: int = 0):
    """One random image (batch of one) at the model's input size. A NaFlexVit has no fixed size: the
    image is at its pretrained input size (the built grid or not), see ``sample_patch_dict`` for the other."""
    g = torch.Generator().manual_seed(seed)
    C, H, W = tm.pretrained_cfg.get("input_size", (3, 224, 224))
    if hasattr(tm, "patch_embed") and getattr(tm.patch_embed, "img_size", None) is not None:
        H, W = tm.patch_embed.img_size
    return torch.rand(1, C, H, W, generator=g)


def sample_patch_dict(tm: nn.Module, *, seed: int = 0) -> dict:
    """A NaFlexVit's second input: one image as a patch dict on a grid other than the built one, of
    another aspect ratio, so the positions are resampled by timm's rule for patch dicts."""
    from vitpipe.nn.naflex import patchify_image

    g = torch.Generator().manual_seed(seed + 1)
    p, q = tm.embeds.patch_size
    gh, gw = tm.embeds.pos_embed_grid_size or (14, 14)
    C, H, W = 3, (gh + 2) * p, max(1, gw - 2) * q
    d = patchify_image(torch.rand(C, H, W, generator=g), (p, q), max_seq_len=(H // p) * (W // q))
    return {k: v[None] for k, v in d.items()}


def one_line(e: BaseException) -> bool:
    return isinstance(e, (ValueError, ConfigError)) and "\n" not in str(e) and len(str(e)) <= 600


def check(name: str, params: int = 0, *, seed: int = 0, std: float = 0.02, **kwargs) -> ZooResult:
    """Convert timm's ``name`` (random weights, see ``random_timm``; ``kwargs`` to ``timm.create_model``)
    and compare logits."""
    from vitpipe.models.timm_compat import from_timm

    start = time.perf_counter()
    tm = random_timm(name, seed=seed, std=std, **kwargs)
    inputs = [sample_input(tm, seed=seed)]
    if type(tm).__name__ == "NaFlexVit":
        inputs.append(sample_patch_dict(tm, seed=seed))

    def done(status: str, detail: str) -> ZooResult:
        return ZooResult(name, params, status, detail, time.perf_counter() - start)

    try:
        model = from_timm(tm).eval()
    except Exception as e:  # noqa: BLE001 - the scan reports what it caught
        if one_line(e):
            return done("refused", str(e))
        first = (str(e).splitlines() or [""])[0][:200]
        return done("exception", f"{type(e).__name__}: {first}")
    worst = (0.0, 0.0, 1.0)  # (relative, abs diff, scale) of the worst input
    for x in inputs:
        try:
            with torch.no_grad():
                theirs, ours = tm(x), model(x)
        except Exception as e:  # noqa: BLE001
            return done("exception", f"{type(e).__name__} in forward: {(str(e).splitlines() or [''])[0][:200]}")
        diff = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else float("inf")
        scale = max(1e-6, theirs.abs().max().item())
        worst = max(worst, (diff / scale, diff, scale))
    status = "parity" if worst[0] <= TOLERANCE else "mismatch"
    return done(status, f"max abs diff {worst[1]:.3g} (logit scale {worst[2]:.3g})")


def scan(points: list[tuple[str, int]], *, progress: bool = True) -> list[ZooResult]:
    from tqdm import tqdm

    results = []
    bar = tqdm(points, disable=not progress, unit="model")
    for name, params in bar:
        bar.set_postfix_str(name)
        results.append(check(name, params))
    return results


def summary(results: list[ZooResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def format_table(results: list[ZooResult]) -> str:
    """A markdown table (entry point, params, status, detail), then the counts and the refusal reasons."""
    lines = ["| entry point | params (M) | result | detail |", "|---|---:|---|---|"]
    for r in results:
        lines.append(f"| `{r.name}` | {r.params / 1e6:.1f} | {r.status} | {r.detail.replace('|', '/')} |")
    counts = summary(results)
    n = len(results)
    lines += ["", "Summary: " + ", ".join(f"{s} {counts[s]}" for s in STATUSES) + f" of {n}"
              + (f" ({100 * counts['parity'] / n:.0f}% with parity)" if n else "")]
    reasons: dict[str, list[str]] = {}
    for r in results:
        if r.status == "refused":
            reasons.setdefault(r.detail, []).append(r.name)
    if reasons:
        lines += ["", "Refusal reasons:", ""]
        for reason, names in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {len(names)}: {reason} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vitpipe.models.timm_zoo", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated timm.list_models patterns")
    ap.add_argument("--max-params", type=float, default=120e6, help="skip entry points with more parameters")
    ap.add_argument("--filter", default=None, help="a glob the names must also match, e.g. 'eva02*'")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    points = entry_points(args.families.split(","), max_params=args.max_params, pattern=args.filter)
    results = scan(points, progress=not args.no_progress)
    print(format_table(results))
    print(f"\n{len(results)} entry points in {time.perf_counter() - start:.0f} s "
          f"(torch {torch.__version__}, timm {__import__('timm').__version__})")
    counts = summary(results)
    return 1 if counts["exception"] or counts["mismatch"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

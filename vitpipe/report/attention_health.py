"""attention_health.png: attention entropy and the largest attention logit per layer against the step,
drawn from ``<run dir>/attention_health.csv`` (written by ``vitpipe.lit.attention_health.AttentionHealth``).

Per layer one colour: entropy, the head with the lowest (solid) and the mean over heads (dashed),
since collapse starts in one head; the largest logit, the head with the highest (solid) and the mean
(dashed), on a symmetric log axis (growth is multiplicative). A dotted line marks uniform attention.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from vitpipe.lit.attention_health import HEALTH_FILE, read_attention_health

HEALTH_SIZE = (11.0, 4.0)  # inches, at the report's 100 dpi
LEGEND_LAYERS = 12  # beyond, the colour alone says deeper (viridis: dark = first layer, yellow = last)


def attention_health_figures(run_dir) -> dict[str, Figure]:
    """{"attention_health": figure} when the run has an attention_health.csv, else {} (the report's hook)."""
    rows = read_attention_health(Path(run_dir) / HEALTH_FILE)
    return {"attention_health": attention_health_figure(rows)} if rows else {}


def attention_health_figure(rows: list[dict]) -> Figure:
    """Two panels from the file's rows (step, layer, head, entropy, entropy_norm, max_logit)."""
    per = defaultdict(lambda: defaultdict(list))  # layer -> step -> [(entropy, max_logit) per head]
    for r in rows:
        per[r["layer"]][r["step"]].append((r["entropy"], r["max_logit"]))
    layers = sorted(per)
    cmap = colormaps["viridis"]
    fig = Figure(figsize=HEALTH_SIZE, dpi=100, layout="constrained")
    ent_ax, logit_ax = fig.subplots(1, 2)
    for n, layer in enumerate(layers):
        color = cmap(n / max(1, len(layers) - 1) * 0.9)  # 0.9: the last layer stays readable on white
        steps = sorted(per[layer])
        heads = [per[layer][s] for s in steps]
        ent = [[e for e, _ in h] for h in heads]
        logit = [[m for _, m in h] for h in heads]
        ent_ax.plot(steps, [min(e) for e in ent], "-", color=color, label=f"layer {layer}")
        ent_ax.plot(steps, [sum(e) / len(e) for e in ent], "--", color=color, alpha=0.6)
        logit_ax.plot(steps, [max(m) for m in logit], "-", color=color, label=f"layer {layer}")
        logit_ax.plot(steps, [sum(m) / len(m) for m in logit], "--", color=color, alpha=0.6)
    ent_ax.set(xlabel="step", ylabel="entropy (nats)", title="Attention entropy: lowest head (solid), mean (dashed)")
    logit_ax.set(xlabel="step", ylabel="largest pre-softmax logit", title="Attention logit: highest head (solid), mean (dashed)")
    logit_ax.set_yscale("symlog", linthresh=1.0)  # growth is multiplicative; logits at init are ~0, may be < 0
    uniform = _log_keys(rows)
    if uniform is not None:
        ent_ax.axhline(uniform, color="gray", linestyle=":", linewidth=1, label=f"uniform, log N = {uniform:.2f}")
    for ax in (ent_ax, logit_ax):
        ax.grid(alpha=0.3)
    if len(layers) <= LEGEND_LAYERS:
        ent_ax.legend(fontsize=8, ncols=2 if len(layers) > 6 else 1)
    else:
        ent_ax.legend(
            handles=[
                Line2D([], [], color=cmap(0.0), label=f"layer {layers[0]}"),
                Line2D([], [], color=cmap(0.9), label=f"layer {layers[-1]}"),
            ],
            fontsize=8,
        )
    return fig


def _log_keys(rows: list[dict]) -> float | None:
    """log N, the entropy of uniform attention, when every row has the same N (entropy / entropy_norm);
    None when the rows disagree (NaFlex: sequence lengths vary) or cannot tell (collapsed rows)."""
    ratios = [r["entropy"] / r["entropy_norm"] for r in rows if r["entropy_norm"] > 0.05]
    if not ratios or max(ratios) - min(ratios) > 0.01 * max(ratios):
        return None
    return sum(ratios) / len(ratios)

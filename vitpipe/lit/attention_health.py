"""AttentionHealth: per-layer, per-head attention entropy and largest attention logit during training.

Two known precursors of a diverging transformer are visible in the attention alone:

- entropy collapse (Zhai et al. 2023, "Stabilizing Transformer Training by Preventing Attention
  Entropy Collapse"): heads whose softmax turns one-hot, entropy near zero, while the loss jumps;
- attention logit growth (Dehghani et al. 2023, ViT-22B; Wortsman et al. 2023, "Small-scale proxies
  for large-scale Transformer training instabilities"): the pre-softmax q.k logits grow without bound,
  which QK-LayerNorm (``model.qk_norm=true``), a lower learning rate or a longer warm-up prevent.

Every ``every_n_steps`` optimizer steps the callback runs one forward pass of its own on a fixed set
of training images (the first ones the run sees), without gradients and in eval mode (no dropout,
no drop-path), asking the ViT for its pre-softmax logits (``forward_features(x, return_logits=True)``,
the attention core's explicit path for that call only); the training steps keep the fused SDPA
kernel. The softmax of those logits is the explicit path's attention (the core computes its weights
the same way), so one pass gives both numbers.

Written to every logger (``attn/entropy/l{i}/h{j}``, ``attn/max_logit/l{i}/h{j}``, layers and heads
from 0) and to ``<run dir>/attention_health.csv``, one row per check, layer and head, which
``vitpipe.report.attention_health`` draws. ``read_attention_health`` is the file's reader.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn

from vitpipe.errors import ConfigError
from vitpipe.models.vit import ViT
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.nn.modes import eval_mode
from vitpipe.run.csvfiles import csv_text, read_csv_dicts
from vitpipe.run.files import atomic_write_text

HEALTH_FILE = "attention_health.csv"
COLUMNS = ["step", "layer", "head", "entropy", "entropy_norm", "max_logit"]
ADVICE = "try a lower module.optimizer.lr, model.qk_norm=true or a longer warm-up (module.warmup_fraction)"
ADVICE_QK_NORM_ON = "try a lower module.optimizer.lr or a longer warm-up (module.warmup_fraction); model.qk_norm is on"


# ---------------------------------------------------------------- the numbers (pure functions)


def attention_stats(logits: Sequence[Tensor], *, query_mask: Tensor | None = None) -> dict[str, Tensor]:
    """Per-layer, per-head statistics of pre-softmax attention logits.

    logits: one (B, heads, N, M) tensor per layer, masked entries -inf (``forward_features(x,
        return_logits=True)``).
    query_mask: bool (B, N), True = a query to count (NaFlex: prefix tokens and valid patches);
        None = every query.
    Returns (layers, heads) float32 tensors: ``entropy``, the mean over images and queries of
    -sum_k p log p in nats; ``entropy_norm``, the same with each query's entropy divided by the log of
    the number of keys it may attend to (1 = uniform, 0 = one-hot); ``max_logit``, the largest
    finite logit over images, queries and keys.
    """
    entropy, entropy_norm, max_logit = [], [], []
    for a in logits:
        a = a.detach().float()  # (B, H, N, M)
        p = a.softmax(dim=-1)
        h = -torch.special.xlogy(p, p).sum(dim=-1)  # (B, H, N); p = 0 (masked keys) adds 0
        keys = torch.isfinite(a).sum(dim=-1)  # (B, H, N) keys each query may attend to
        h_norm = torch.where(keys > 1, h / keys.clamp(min=2).log(), torch.zeros_like(h))
        finite = torch.where(torch.isfinite(a), a, torch.full_like(a, -math.inf)).amax(dim=-1)  # (B, H, N)
        if query_mask is None:
            w = torch.ones(h.shape[0], h.shape[2], device=h.device)
        else:
            w = query_mask.to(device=h.device, dtype=h.dtype)  # (B, N)
        w = w[:, None, :].expand_as(h)  # (B, H, N)
        count = w.sum(dim=(0, 2)).clamp(min=1)  # (H,)
        entropy.append((h * w).sum(dim=(0, 2)) / count)
        entropy_norm.append((h_norm * w).sum(dim=(0, 2)) / count)
        finite = torch.where(w > 0, finite, torch.full_like(finite, -math.inf))
        max_logit.append(finite.amax(dim=(0, 2)))
    return {
        "entropy": torch.stack(entropy).cpu(),
        "entropy_norm": torch.stack(entropy_norm).cpu(),
        "max_logit": torch.stack(max_logit).cpu(),
    }


def find_vit(pl_module: L.LightningModule) -> ViT | None:
    """The ViT a run trains: the module's ``net`` (a classifier), or its ``encoder`` (a captioner);
    None for anything else (a timm model, an MAE). The trained weights, not an EMA copy: the health
    of the optimisation is what is watched."""
    net = getattr(pl_module, "net", None)
    for candidate in (net, getattr(net, "encoder", None)):
        if isinstance(candidate, ViT):
            return candidate
    return None




def _has_qk_norm(net: nn.Module) -> bool:
    return any(isinstance(m, MultiHeadAttention) and not isinstance(m.q_norm, nn.Identity) for m in net.modules())


def _inputs(batch, n: int):
    """A copy of the first ``n`` images of a training batch on the CPU: a tensor (n, C, H, W) or a NaFlex
    patch dict; None for a batch holding neither."""
    x = batch
    if isinstance(x, dict) and "images" in x:  # a captioning batch
        x = x["images"]
    elif isinstance(x, (list, tuple)):  # (images, targets)
        x = x[0]
    if isinstance(x, dict):
        return {k: v[:n].detach().to("cpu", copy=True) for k, v in x.items() if isinstance(v, Tensor)}
    return x[:n].detach().to("cpu", copy=True) if isinstance(x, Tensor) else None


def _to(x, device: torch.device, dtype: torch.dtype):
    if isinstance(x, dict):
        return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in x.items()}
    return x.to(device, dtype)


def measure(net: ViT, x) -> dict[str, Tensor]:
    """``attention_stats`` of ``net`` on ``x`` (images or a patch dict): one forward pass, no
    gradients, eval mode, each submodule's mode restored after."""
    param = next((p for p in net.parameters() if p.is_floating_point()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    x = _to(x, device, dtype)
    with torch.no_grad(), eval_mode(net):
        _, logits = net.forward_features(x, return_logits=True)  # explicit path, this call only
    query_mask = None
    if isinstance(x, dict):  # NaFlex: padding queries do not count
        valid = x["patch_valid"]
        query_mask = torch.cat([valid.new_ones(valid.shape[0], net.num_prefix_tokens), valid], dim=1)
    return attention_stats(logits, query_mask=query_mask)


# ---------------------------------------------------------------- the callback


class AttentionHealth(L.Callback):
    """Every ``every_n_steps`` optimizer steps (at step 0, before the first update, and once more at
    the end of training), measure the attention of the fixed images, log it, rewrite the run's
    ``attention_health.csv`` and warn once per signal per run (rank 0, one line on stderr).

    Args:
        every_n_steps: steps between checks.
        num_images: the first images of the first training batch, kept for the whole run (and in
            checkpoints, so a resumed run measures the same images).
        normalize: log and threshold the entropy divided by log(keys) (in [0, 1], the same scale for
            every sequence length) instead of nats. The file holds both.
        min_entropy: warn when a head's entropy (in the logged unit) falls below this; null = never.
        max_logit: warn when a head's largest pre-softmax logit exceeds this; null = never.
        growth_checks, growth_factor, growth_from: also warn when a head's largest logit rose at each
            of the last ``growth_checks`` checks, by ``growth_factor`` over them in all, from at least
            ``growth_from`` (in any healthy run the logits grow from ~0 at initialisation to their
            working range first, which is no warning); growth_checks null = no growth rule.
        dirpath: the run directory; None = ``trainer.default_root_dir``.
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 50,
        num_images: int = 8,
        normalize: bool = False,
        min_entropy: float | None = 0.1,
        max_logit: float | None = 100.0,
        growth_checks: int | None = 5,
        growth_factor: float = 2.0,
        growth_from: float = 20.0,
        dirpath: str | None = None,
    ) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("num_images", num_images)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"callbacks.attention_health.{name}={value!r}: use an int >= 1")
        if growth_checks is not None and (
            isinstance(growth_checks, bool) or not isinstance(growth_checks, int) or growth_checks < 1
        ):
            raise ConfigError(
                f"callbacks.attention_health.growth_checks={growth_checks!r}: use an int >= 1, or null (no growth rule)"
            )
        if not growth_factor > 1:
            raise ConfigError(f"callbacks.attention_health.growth_factor={growth_factor!r}: use a number > 1")
        self.every_n_steps, self.num_images, self.normalize = every_n_steps, num_images, bool(normalize)
        self.min_entropy, self.max_logit = min_entropy, max_logit
        self.growth_checks, self.growth_factor, self.growth_from = growth_checks, float(growth_factor), growth_from
        self.dirpath = dirpath
        self.inputs = None  # the fixed images: a tensor (n, C, H, W) or a patch dict, on the CPU
        self.checks: list[dict] = []  # {"step": int, "entropy" | "entropy_norm" | "max_logit": [[layer][head]]}
        self.warned: dict[str, bool] = {"entropy": False, "logit": False}
        self.off = False
        self.advice = ADVICE  # what the warnings suggest; without qk_norm's line for a model that has it

    def path(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath or trainer.default_root_dir) / HEALTH_FILE

    def state_dict(self) -> dict:
        return {"checks": [dict(c) for c in self.checks], "warned": dict(self.warned), "inputs": self.inputs}

    def load_state_dict(self, state: dict) -> None:
        self.checks = [dict(c) for c in state.get("checks", [])]
        self.warned = {"entropy": False, "logit": False, **state.get("warned", {})}
        self.inputs = state.get("inputs")

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.off = find_vit(pl_module) is None
        if self.off and trainer.is_global_zero:
            print(
                f"vitpipe: note: callbacks.attention_health: {type(getattr(pl_module, 'net', pl_module)).__name__} "
                "is not a vitpipe ViT (nor has one as its encoder); no attention health in this run",
                flush=True,
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after a resume the loop goes on from global_step: checks at or after it are measured again
        self.checks = [c for c in self.checks if c["step"] < trainer.global_step]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self.off:
            return
        if self.inputs is None:
            self.inputs = _inputs(batch, self.num_images)
            if self.inputs is None:
                self.off = True
                return
        step = trainer.global_step  # optimizer steps done (accumulated micro-batches share one)
        if step % self.every_n_steps == 0 and not self._checked(step):
            self.check(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.off and self.inputs is not None and not self._checked(trainer.global_step):
            self.check(trainer, pl_module)  # the trained model, whatever the step

    def _checked(self, step: int) -> bool:
        return bool(self.checks) and self.checks[-1]["step"] == step

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Tensor]:
        """Measure, log, write the file and apply the warning rules; returns the statistics.

        Every rank runs the forward pass (a sharded model, FSDP, needs all of them in every forward);
        rank 0 logs and writes."""
        net = find_vit(pl_module)
        stats = measure(net, self.inputs)
        self.advice = ADVICE_QK_NORM_ON if _has_qk_norm(net) else ADVICE
        step = trainer.global_step
        self.checks.append({"step": step, **{k: v.tolist() for k, v in stats.items()}})
        if trainer.is_global_zero:
            key = "entropy_norm" if self.normalize else "entropy"
            metrics = {
                f"attn/{name}/l{i}/h{j}": float(v)
                for name, values in (("entropy", stats[key]), ("max_logit", stats["max_logit"]))
                for i, row in enumerate(values)
                for j, v in enumerate(row)
            }
            metrics["attn/entropy_min"] = float(stats[key].min())
            metrics["attn/max_logit_max"] = float(stats["max_logit"].max())
            for logger in trainer.loggers:
                # straight to the loggers: pl_module.log from a callback hook reaches them only at
                # trainer.log_every_n_steps boundaries, and a check between two would be dropped
                logger.log_metrics(metrics, step=step)
            atomic_write_text(self.path(trainer), health_csv(self.checks))
            for line in self.warnings():
                # on a line of its own: the progress bar (stderr) is mid-line (as vitpipe.lit.preemption.signals)
                print(f"\nvitpipe: warning: {line}", file=sys.stderr, flush=True)
        return stats

    def warnings(self) -> list[str]:
        """The warning lines the newest check raises (each signal at most once per run)."""
        c = self.checks[-1]
        lines = []
        unit = "entropy_norm" if self.normalize else "entropy"
        if self.min_entropy is not None and not self.warned["entropy"]:
            values = torch.tensor(c[unit])  # (layers, heads)
            if float(values.min()) < self.min_entropy:
                i, j = divmod(int(values.argmin()), values.shape[1])
                what = "entropy / log(keys)" if self.normalize else "entropy"
                lines.append(
                    f"attention entropy collapse at step {c['step']}: layer {i} head {j} {what} "
                    f"{float(values[i, j]):.3g}{'' if self.normalize else ' nats'} < "
                    f"callbacks.attention_health.min_entropy={self.min_entropy:g} (Zhai et al. 2023); " + self.advice
                )
                self.warned["entropy"] = True
        if not self.warned["logit"]:
            line = self._logit_warning()
            if line:
                lines.append(line)
                self.warned["logit"] = True
        return lines

    def _logit_warning(self) -> str | None:
        c = self.checks[-1]
        values = torch.tensor(c["max_logit"])  # (layers, heads)
        where = f"attention logit growth at step {c['step']}: layer {{i}} head {{j}} max pre-softmax logit {{v:.4g}}"
        cite = " (Dehghani et al. 2023; Wortsman et al. 2023); " + self.advice
        if self.max_logit is not None and float(values.max()) > self.max_logit:
            i, j = divmod(int(values.argmax()), values.shape[1])
            return (
                where.format(i=i, j=j, v=float(values[i, j]))
                + f" > callbacks.attention_health.max_logit={self.max_logit:g}"
                + cite
            )
        k = self.growth_checks
        if k is None or len(self.checks) < k + 1:
            return None
        series = torch.tensor([ch["max_logit"] for ch in self.checks[-(k + 1) :]])  # (k + 1, layers, heads)
        rising = (series.diff(dim=0) > 0).all(dim=0)
        first, last = series[0], series[-1]
        ratio = torch.where(first > 0, last / first.clamp(min=1e-12), torch.zeros_like(last))
        hit = rising & (ratio >= self.growth_factor) & (first >= self.growth_from)
        if not bool(hit.any()):
            return None
        i, j = divmod(int(torch.where(hit, ratio, torch.zeros_like(ratio)).argmax()), values.shape[1])
        return (
            where.format(i=i, j=j, v=float(last[i, j]))
            + f" rose at each of the last {k} checks, x{float(ratio[i, j]):.3g} from step "
            f"{self.checks[-(k + 1)]['step']} (callbacks.attention_health.growth_checks={k}, "
            f"growth_factor={self.growth_factor:g}, growth_from={self.growth_from:g})" + cite
        )


# ---------------------------------------------------------------- the file


def health_csv(checks: list[dict]) -> str:
    """The checks as CSV text: one row per check, layer and head (``COLUMNS``)."""
    rows = (
        [c["step"], i, j, *(f"{c[k][i][j]:.6g}" for k in COLUMNS[3:])]
        for c in checks
        for i in range(len(c["entropy"]))
        for j in range(len(c["entropy"][i]))
    )
    return csv_text(rows, COLUMNS)


def read_attention_health(path) -> list[dict[str, float]]:
    """attention_health.csv -> rows {step, layer, head (ints), entropy, entropy_norm, max_logit};
    [] when there is no file."""
    path = Path(path)
    if not path.is_file():
        return []
    return [
        {k: int(row[k]) if k in ("step", "layer", "head") else float(row[k]) for k in COLUMNS} for row in read_csv_dicts(path)
    ]

"""What a run leaves behind beside its checkpoints: metrics.json, config.yaml (stored by the checkpoints' rule,
``vitpipe.run.stored``, which also writes the config inside checkpoints), a summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitpipe.run.files import atomic_write_text
from vitpipe.run.stored import stored_config


def output_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir)


def run_config(cfg: DictConfig) -> dict:
    """The resolved config as config.yaml holds it: the same rule as the config stored in checkpoints
    (vitpipe.run.stored.ConfigInCheckpoint), so the two stay equal."""
    return stored_config(OmegaConf.to_container(cfg, resolve=True))


@rank_zero_only
def write_run_files(cfg: DictConfig, metrics: dict) -> None:
    out = output_dir(cfg)
    atomic_write_text(out / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(run_config(cfg))))
    if metrics:
        atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def collect_metrics(trainer: L.Trainer, prefix: str = "") -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix) and v.numel() == 1}


@rank_zero_only
def print_summary(cfg: DictConfig, metrics: dict, trainer: L.Trainer) -> None:
    keys = [k for k in ("val/acc_best", "test/acc", "test/acc_top5", "test/loss") if k in metrics]
    keys += sorted(k for k in metrics if k.startswith("test/") and k not in keys)
    lines = [f"  {k:<16} {metrics[k]:.4f}" for k in keys]
    if "time/fit_s" in metrics:
        lines.append(f"  {'fit wall time':<16} {metrics['time/fit_s']:.0f} s")
    best = getattr(trainer.checkpoint_callback, "best_model_path", "") if trainer.checkpoint_callback else ""
    print("\n".join([f"== vitpipe {cfg.task_name}: {cfg.model.get('name', cfg.model._target_)} on "
                     f"{cfg.data._target_.rsplit('.', 1)[-1]} ==", *lines,
                     f"  run dir          {output_dir(cfg)}"] + ([f"  best checkpoint  {best}"] if best else [])))


def finish_loggers(loggers: list, status: str) -> None:
    """Close wandb runs (so a sweep's next job starts a new run) and flush the others, telling each how
    the run ended: ``status`` is Lightning's "success" or "failed" (``Logger.finalize(status)``;
    TensorBoard saves its hparams only on success) and wandb's exit code 0 or 1 (wandb shows 1 as a
    failed run). No default: a caller must say how the run ended.

    A logger that cannot finish (a full disk, wandb unreachable) is named in one line on stderr and
    the others still finish; it never raises, so it cannot replace the run's own error."""
    if status not in ("success", "failed"):
        raise ValueError(f"status={status!r}; valid choices: success, failed")
    for lg in loggers:
        try:
            if isinstance(lg, WandbLogger):
                import wandb

                if wandb.run is not None:
                    wandb.finish(exit_code=0 if status == "success" else 1)
            elif hasattr(lg, "finalize"):
                lg.finalize(status)
        except Exception as e:  # noqa: BLE001 - one line, then the next logger
            why = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__
            print(f"vitpipe: warning: logger {type(lg).__name__} did not finish (status {status}): {why}",
                  file=sys.stderr, flush=True)

"""``train(cfg) -> metrics``: the testable body of ``scripts/train.py``.

Config -> data, model, LightningModule, Trainer -> fit -> test with the best checkpoint ->
``metrics.json`` and ``config.yaml`` in the run directory. Everything that can be checked from the
config alone is checked before any data loads.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from vitpipe.config.build import (
    apply_lr_scaling,
    build_trainer,
    instantiate_callbacks,
    instantiate_loggers,
    set_sweep_group,
)
from vitpipe.config.duration import parse_duration
from vitpipe.config.preflight import preflight
from vitpipe.config.recipe import announce_recipe
from vitpipe.errors import ConfigError
from vitpipe.lit.time_budget import RunClock, TrainingClock
from vitpipe.run.build import build_data, build_from_config
from vitpipe.run.dirs import live
from vitpipe.run.info import (
    collect_metrics,
    finish_loggers,
    output_dir,
    print_summary,
    run_config,
    write_run_files,
)
from vitpipe.run.mlflow_logger import log_config, log_outcome
from vitpipe.run.paths import resolve_ckpt_path, resumable_by
from vitpipe.run.stored import STATE_DICT, ConfigInCheckpoint, check_fits, load_checkpoint


def train(cfg: DictConfig) -> dict[str, float]:
    """Train (and test) per ``cfg``; returns the final metrics, also written to metrics.json.

    While it runs, the run directory is marked live (``vitpipe.run.dirs``): ``ckpt_path=last`` passes
    over it instead of forking a run that is still being written."""
    with live(output_dir(cfg)):
        return _train(cfg)


def _train(cfg: DictConfig) -> dict[str, float]:
    clock = RunClock()  # a time budget is the whole run's: from the process's start (imports, Hydra) on
    preflight(cfg, "train")  # first, once: a bad value (seed=-5 included) is one line before anything runs
    dm = build_data(cfg)  # then the data's files (an image folder's links, a shard index): one line, no banner first
    L.seed_everything(cfg.seed, workers=True)
    announce_recipe(cfg)  # which conf/recipe/<model>_<data>.yaml this run merged, and what it set
    set_sweep_group(cfg)
    loggers = instantiate_loggers(cfg.get("logger"))
    status = "failed"  # what the loggers are told unless the run gets to its end
    try:
        callbacks = instantiate_callbacks(cfg.get("callbacks"))
        if not loggers:  # logger=none: nothing to log a learning rate to (Lightning would refuse to start)
            callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
        callbacks.append(ConfigInCheckpoint(cfg))  # eval rebuilds the model from the checkpoint alone
        budget_s = parse_duration(cfg.trainer.get("time_budget"))
        # the expected duration; with a budget, the plan fitted to it
        timing = TrainingClock(budget_s, clock, tests=bool(cfg.get("test", True)))
        callbacks.append(timing)
        trainer: L.Trainer = build_trainer(cfg.trainer, callbacks=callbacks, logger=loggers or False,
                                           **slurm_plugins(cfg))
        apply_lr_scaling(cfg, trainer)  # needs the world size, which only the Trainer knows
        dm, net, module = build_from_config(cfg, dm=dm)  # cfg checked above (preflight, first line)
        ckpt_path = resume_path(cfg, net)
        write_run_files(cfg, {})
        log_config(loggers, run_config(cfg))  # MLflow's params: config.yaml's values, flattened
        fit_s = None
        if cfg.get("train", True):
            start = time.perf_counter()
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
            fit_s = time.perf_counter() - start
        metrics = collect_metrics(trainer)
        if fit_s is not None:  # this process's fit, in seconds (a resumed run: the part after the resume)
            metrics["time/fit_s"] = fit_s
        if cfg.get("test", True):
            best = _best_checkpoint(trainer)
            trainer.test(module, datamodule=dm, ckpt_path=best, weights_only=True)
            metrics.update(collect_metrics(trainer, prefix="test/"))
        metrics.update(timing.outcome())
        timing.announce_outcome(trainer)
        write_run_files(cfg, metrics)
        log_outcome(loggers, metrics, trainer.global_step, output_dir(cfg))  # MLflow: metrics.json's values, files
        print_summary(cfg, metrics, trainer)
        status = "success"
        return metrics
    finally:
        clock.stop()
        finish_loggers(loggers, status)


def resume_path(cfg: DictConfig, net) -> str | None:
    """The checkpoint ``cfg.ckpt_path`` resumes from, checked to fit ``net`` now rather than after the
    data loads: a file; a run directory or ``last`` (the newest run of this task): its last.ckpt;
    ``auto`` (the default): this run directory's own last.ckpt when it has one (a requeued SLURM job,
    a rerun into a fixed ``hydra.run.dir``), else none, saying which."""
    value = cfg.get("ckpt_path")
    if value in (None, ""):
        earlier = own_checkpoint(output_dir(cfg))
        if earlier is not None and cfg.get("train", True):  # Lightning would write last-v1.ckpt beside it
            raise ConfigError(f"ckpt_path=null, but {output_dir(cfg)} already holds {earlier.name} of an earlier run; "
                              "pass ckpt_path=auto to continue that run, or another hydra.run.dir to start afresh")
        return None
    if str(value) == AUTO:
        path = own_checkpoint(output_dir(cfg))
        if path is None:
            _say(f"vitpipe: ckpt_path=auto: no checkpoint in {output_dir(cfg)} yet; training from the start")
            return None
        _say(f"vitpipe: ckpt_path=auto: this run directory holds {path}; resuming from it")
    else:
        path = resolve_ckpt_path(value, log_dir=Path(cfg.paths.log_dir) / cfg.task_name, which="last",
                                 usable=resumable_by(net, cfg))  # last: the newest run of this task and model
    checkpoint = load_checkpoint(path)
    check_fits(checkpoint[STATE_DICT], net, path)  # PreemptionCheckpoint prints the step when fit loads it
    return str(path)


AUTO = "auto"


def own_checkpoint(run_dir) -> Path | None:
    """``<run_dir>/checkpoints/last.ckpt`` (the newest state the run wrote), or None."""
    path = Path(run_dir) / "checkpoints" / "last.ckpt"
    return path if path.is_file() else None


@rank_zero_only
def _say(line: str) -> None:
    print(line, flush=True)


def slurm_plugins(cfg: DictConfig) -> dict:
    """Inside a SLURM job: Lightning's SLURM environment (ranks from SLURM) without its auto-requeue.
    That saves a checkpoint from inside its SIGUSR1 handler, mid-batch, into a file vitpipe never
    resumes from; pre-emption here is submitit's requeue plus vitpipe's batch-boundary last.ckpt
    (``PreemptionCheckpoint``) and ``ckpt_path=auto``."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return {}
    from hydra.utils import instantiate

    plugins = [instantiate(p) for p in (cfg.trainer.get("plugins") or [])]
    return {"plugins": [*plugins, SLURMEnvironment(auto_requeue=False)]}


def _best_checkpoint(trainer: L.Trainer) -> str | None:
    cb = trainer.checkpoint_callback
    if trainer.fast_dev_run or cb is None:
        return None  # the weights in memory
    if not getattr(cb, "best_model_path", ""):
        if getattr(cb, "last_model_path", ""):
            return cb.last_model_path
        raise ConfigError("no checkpoint was saved during fit; cannot test with the best weights")
    return cb.best_model_path

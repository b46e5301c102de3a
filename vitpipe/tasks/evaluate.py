"""``evaluate(cfg) -> metrics``: test a checkpoint (the body of ``scripts/eval.py``).

The checkpoint is read once (``vitpipe.run.checkpoint``) and its run rebuilt from its stored model,
data and module config, checked against an allow-list before anything is built. Output
directories, data roots and the Trainer come from the eval config, never from the checkpoint.

``model_patch_size=<p>``: test the ViT at another patch size than it was built with (FlexiViT,
Beyer et al. 2023: its patch kernel PI-resized to p x p, positions resampled to the new grid); any p
dividing the model's img_size runs, a model trained with ``model.flexi_patch_sizes`` does well at those.

``model_tome_r=<r>``: test it with token merging (ToMe), r tokens merged per block (``vitpipe.inference.vit_options``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from vitpipe.config.build import build_trainer
from vitpipe.config.options import check_model_tome_r
from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError
from vitpipe.inference.vit_options import set_patch_size, set_tome_r
from vitpipe.report.evaluation import (
    carve_warning,
    eval_options,
    evaluate_with_report,
    multilabel_refusal,
    report_callbacks,
    unseen_flip_warning,
)
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.info import print_summary, write_run_files
from vitpipe.run.outputs import check_not_input, checkpoint_inputs
from vitpipe.run.paths import resolve_ckpt_path
from vitpipe.run.stored import config_of, load_checkpoint

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    preflight(cfg, "eval")  # seed=-5: one line, not numpy's traceback from seed_everything
    L.seed_everything(cfg.seed, workers=True)
    opts = eval_options(cfg)  # split / calibrate / tta checked before anything loads
    patch_size = model_patch_size(cfg)
    tome_r = check_model_tome_r(cfg.get("model_tome_r"))
    if tome_r is not None and cfg.get("calibrate"):
        raise ConfigError(f"calibrate=true with model_tome_r={tome_r}: calibration.json is applied by predict to the "
                          "run as trained; calibrate without model_tome_r")
    path = resolve_ckpt_path(cfg.ckpt_path, log_dir=cfg.paths.log_dir, which="best")
    # the eval's run dir (metrics.json, report/) is not the run it reads (ckpt_path=last resolved; vitpipe.run.outputs)
    check_not_input(cfg.paths.output_dir, checkpoint_inputs(path, cfg.ckpt_path), key="hydra.run.dir", folder=True)
    checkpoint = load_checkpoint(path)
    refusal = multilabel_refusal(config_of(checkpoint), opts)  # before any data loads
    if refusal:
        raise ConfigError(refusal)
    for warning in (unseen_flip_warning(config_of(checkpoint), opts.tta),
                    carve_warning(config_of(checkpoint), cfg.get("data"))):
        if warning:
            print(f"vitpipe: warning: {warning}", file=sys.stderr, flush=True)
    run = rebuild(checkpoint, path, data=cfg.get("data"), paths=cfg.paths, task_name=cfg.task_name, need_data=True)
    if patch_size is not None:
        set_patch_size(run.module, patch_size)
    if tome_r is not None:
        set_tome_r(run.module, tome_r)
    log.info("evaluating %s%s%s", path, f" at patch size {patch_size}" if patch_size is not None else "",
             f" merging {tome_r} tokens per block" if tome_r else "")
    trainer = build_trainer(cfg.trainer, logger=False, callbacks=report_callbacks(cfg))
    # the weights are in the module already: no ckpt_path, so Lightning does not read the file again;
    # predictions.csv + report/ (and calibration.json with calibrate=true): vitpipe.report.evaluation
    metrics = evaluate_with_report(cfg, trainer, run.module, run.datamodule, path, checkpoint)
    if hasattr(run.module, "write_predictions"):  # captioners: generated captions next to the scores
        run.module.write_predictions(Path(cfg.paths.output_dir) / "captions.json")
    write_run_files(run.cfg, metrics)
    print_summary(run.cfg, metrics, trainer)
    return metrics


def model_patch_size(cfg: DictConfig) -> int | None:
    """``model_patch_size`` of an eval config: null or a positive int, checked before anything loads."""
    p = cfg.get("model_patch_size")
    if p is None:
        return None
    if not isinstance(p, int) or isinstance(p, bool) or p <= 0:
        raise ConfigError(f"model_patch_size={p!r}; use null (the trained patch size) or a positive integer "
                          "dividing the model's img_size")
    if cfg.get("calibrate"):
        raise ConfigError(f"calibrate=true with model_patch_size={p}: calibration.json is applied by predict at the "
                          "trained patch size; calibrate without model_patch_size")
    return p

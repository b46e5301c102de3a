"""``evaluate(cfg) -> metrics``: test a checkpoint (the body of ``scripts/eval.py``).

The checkpoint is read once (``vitpipe.run.checkpoint``) and its run rebuilt from its stored model,
data and module config, checked against an allow-list before anything is built. Output
directories, data roots and the Trainer come from the eval config, never from the checkpoint.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from vitpipe.config.build import instantiate_checked
from vitpipe.report.evaluation import (
    carve_warning,
    eval_options,
    evaluate_with_report,
    report_callbacks,
    unseen_flip_warning,
)
from vitpipe.run.checkpoint import load_checkpoint, rebuild
from vitpipe.run.info import print_summary, write_run_files
from vitpipe.run.paths import resolve_ckpt_path

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True)
    opts = eval_options(cfg)  # split / calibrate / tta checked before anything loads
    path = resolve_ckpt_path(cfg.ckpt_path, log_dir=cfg.paths.log_dir, which="best")
    checkpoint = load_checkpoint(path)
    for warning in (unseen_flip_warning(checkpoint.get("vitpipe_config"), opts.tta),
                    carve_warning(checkpoint.get("vitpipe_config"), cfg.get("data"))):
        if warning:
            print(f"vitpipe: warning: {warning}", file=sys.stderr, flush=True)
    run = rebuild(checkpoint, path, data=cfg.get("data"), paths=cfg.paths, task_name=cfg.task_name, need_data=True)
    log.info("evaluating %s", path)
    trainer = instantiate_checked(cfg.trainer, "trainer", logger=False, callbacks=report_callbacks(cfg))
    # the weights are in the module already: no ckpt_path, so Lightning does not read the file again;
    # predictions.csv + report/ (and calibration.json with calibrate=true): vitpipe.report.evaluation
    metrics = evaluate_with_report(cfg, trainer, run.module, run.datamodule, path, checkpoint)
    if hasattr(run.module, "write_predictions"):  # captioners: generated captions next to the scores
        run.module.write_predictions(Path(cfg.paths.output_dir) / "captions.json")
    write_run_files(run.cfg, metrics)
    print_summary(run.cfg, metrics, trainer)
    return metrics

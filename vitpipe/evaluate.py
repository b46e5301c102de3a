"""``evaluate(cfg) -> metrics``: test a checkpoint (the body of ``scripts/eval.py``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf, open_dict

from vitpipe.config import check_fits, instantiate_checked, load_checkpoint, resolve_ckpt_path
from vitpipe.errors import ConfigError
from vitpipe.runinfo import collect_metrics, print_summary, write_run_files
from vitpipe.train import build


def run_config(cfg: DictConfig) -> tuple[str, DictConfig]:
    """The checkpoint path and the training config stored in it, with ``cfg.data`` (if given)
    replacing the training data and ``cfg.paths``/``trainer`` taken from the eval config."""
    path = resolve_ckpt_path(cfg.ckpt_path, cfg)
    ckpt = load_checkpoint(path)
    if "vitpipe_config" not in ckpt:
        raise ConfigError(f"{path} has no vitpipe config inside; it was not written by scripts/train.py")
    train_cfg = OmegaConf.create(ckpt["vitpipe_config"])
    with open_dict(train_cfg):
        if cfg.get("data") is not None:
            train_cfg.data = cfg.data  # its ${model.*} interpolations resolve against the stored model
        train_cfg.paths = cfg.paths
        train_cfg.task_name = cfg.task_name
        for key in ("pretrained", "encoder_ckpt"):  # the checkpoint has the weights: read nothing else
            if train_cfg.model.get(key) is not None:
                train_cfg.model[key] = None
    return path, train_cfg


def evaluate(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True)
    path, train_cfg = run_config(cfg)
    checkpoint = load_checkpoint(path)
    dm, net, module = build(train_cfg, checkpoint=checkpoint)
    check_fits(checkpoint["state_dict"], net, path)
    trainer = instantiate_checked(cfg.trainer, "trainer", logger=False)
    trainer.test(module, datamodule=dm, ckpt_path=path, weights_only=True)
    metrics = collect_metrics(trainer, prefix="test/")
    out = Path(cfg.paths.output_dir)
    if hasattr(module, "write_predictions"):  # captioners: generated captions next to the scores
        module.write_predictions(out / "captions.json")
    write_run_files(train_cfg, metrics)
    print_summary(train_cfg, metrics, trainer)
    return metrics

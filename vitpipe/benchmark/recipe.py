"""The training recipe every comparison times: the config ``scripts/train.py model=<variant> data=synthetic``
composes (model, AdamW groups, schedule, label smoothing, gradient clipping), so the benchmark measures
the recipe itself, not a hand-made copy of it. It reads the checkout's ``conf/``."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from vitpipe.benchmark.config import BenchConfig
from vitpipe.lit.optim import build_optimizer
from vitpipe.run.paths import CONF_DIR as CONF


def compose_conf(config_name: str, overrides: list[str]):
    """``conf/<config_name>.yaml`` with ``overrides``, composed as the scripts compose it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def recipe(cfg: BenchConfig, *, batches: int = 1, native_size: int | None = None):
    """The training config as ``scripts/train.py model=<variant> data=synthetic`` composes it, with
    exactly ``batches`` training batches of random uint8 images and no validation split."""
    overrides = [
        f"model={cfg.variant}", f"model.img_size={cfg.size}", "data=synthetic", f"data.num_classes={cfg.num_classes}",
        f"data.native_size={native_size or cfg.size}", f"data.length={batches * cfg.batch_size}",
        f"data.test_length={cfg.batch_size}", f"data.batch_size={cfg.batch_size}", "data.val_split=0",
        f"data.seed={cfg.seed}", f"++data.pin_memory={cfg.device == 'cuda'}", f"compile={cfg.compile}",
        f"trainer={'gpu' if cfg.device == 'cuda' else 'cpu'}", f"trainer.precision={cfg.precision}",
        "trainer.limit_val_batches=0", f"paths.root_dir={CONF.parent}", "paths.output_dir=${paths.log_dir}/benchmark",
    ]  # paths: what @hydra.main would fill in; nothing is written there (no logger, no checkpoints)
    return compose_conf("train", overrides)


def optimizer(train_cfg, net: torch.nn.Module) -> torch.optim.Optimizer:
    """The recipe's optimizer on the training code's parameter groups."""
    return build_optimizer(instantiate(train_cfg.module.optimizer), net)

"""A stored run ready for inference: ``load_predictor(ckpt_path) -> Predictor``, everything predict,
serve and demo do before the first image (resolve, safe load, rebuild through vitpipe's own builders,
eval transform, the calibration temperature or the multi-label thresholds beside the checkpoint), and a
captioner's captions with the decoding settings its run validated with.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vitpipe.config.options import check_tta
from vitpipe.data.preprocess import Preprocess, naflex_settings
from vitpipe.errors import ConfigError
from vitpipe.inference.labels import class_thresholds
from vitpipe.inference.probs import calibration_temperature
from vitpipe.inference.vit_options import set_tome_r
from vitpipe.kinds import TaskKind, kind_of_checkpoint
from vitpipe.run.stored import config_of


@dataclass
class Predictor:
    """A checkpoint ready to predict, as predict, serve and demo use it: the network on its device in eval
    mode, its task kind, the checkpoint's eval transform, and the calibration temperature for ``tta``."""

    path: Path  # the checkpoint file ckpt_path resolved to
    checkpoint: dict  # as load_checkpoint read it (weights only)
    built: Any  # vitpipe.run.checkpoint.Rebuilt
    net: torch.nn.Module
    kind: TaskKind  # vitpipe.kinds: multiclass, multilabel (label sets at ``thresholds``) or captioning
    preprocess: Preprocess  # PIL image -> (C, H, W) tensor, or a NaFlex patch dict
    tta: str
    temperature: float | None  # of a calibration.json fitted on this checkpoint with this tta, else None
    thresholds: Tensor | None = None  # (classes,) for a multi-label checkpoint


def load_predictor(ckpt_path, *, paths=None, task_name: str = "predict", device="cpu", tta: str = "none",
                   threshold: float | None = None, tome_r: int | None = None) -> Predictor:
    """Resolve ``ckpt_path`` (file | run dir | last), read it safely, rebuild the network and its eval
    transform (the NaFlex rule for NaFlex checkpoints) and find the calibration temperature: everything
    ``predict`` does before the first image. ConfigError (one line) for a checkpoint or ``tta`` it cannot use.

    Multi-label checkpoints: ``thresholds`` per class are ``threshold`` when given, else those of a
    thresholds.json beside the checkpoint fitted on it (``scripts/eval.py split=val tune_thresholds=true``),
    else the run's ``module.threshold``; tta and calibration.json do not apply (tta refused).

    ``tome_r``: merge that many tokens per block (ToMe, ``vitpipe.inference.vit_options``); None keeps the run's own.
    A calibration.json was fitted on the run as trained: it is not applied at another ``tome_r``."""
    from vitpipe.report.evaluation import unseen_flip_warning
    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.paths import needs_kinds, resolve_ckpt_path
    from vitpipe.run.stored import load_checkpoint

    check_tta(tta)
    path = resolve_ckpt_path(ckpt_path, log_dir=paths.log_dir if paths is not None else None, which="best",
                             usable=needs_kinds("classifier", "captioner", command=task_name))  # last: not an MAE run
    checkpoint = load_checkpoint(path)
    kind = kind_of_checkpoint(checkpoint)
    label_sets = kind is not None and kind.name == "multilabel"  # a sigmoid per class, cut at thresholds
    if label_sets and tta != "none":
        raise ConfigError(f"tta={tta} averages softmax probabilities; this checkpoint is multi-label "
                          "(module.task=multilabel): use tta=none")
    if threshold is not None and not label_sets:
        raise ConfigError(f"threshold={threshold} applies to multi-label checkpoints; this one is single-label: drop it")
    built = rebuild(checkpoint, path, paths=paths, task_name=task_name)
    net = built.net.to(device).eval()
    own_tome_r = getattr(net, "tome_r", 0)
    if tome_r is not None:
        set_tome_r(net, tome_r)
    answers = kind is not None and (kind.generates or (kind.classifies and getattr(net, "num_classes", None)))
    if not answers:  # e.g. MAE pre-training: no classes to answer
        raise ConfigError(f"{path} holds a {type(net).__name__}, not a classifier or a captioner; {task_name} "
                          "answers those: fine-tune it into a classifier first (model.pretrained=<its run>, docs/mae.md)")
    if kind.generates and tta != "none":
        raise ConfigError(f"tta={tta} applies to classifiers; this checkpoint is a captioner: drop tta")
    warning = unseen_flip_warning(config_of(checkpoint), tta)
    if warning:  # the same averaging as eval's tta=hflip, the same loss on a network that never saw a flip
        print(f"vitpipe: warning: {warning}", file=sys.stderr, flush=True)
    naflex = naflex_settings(config_of(checkpoint))
    if naflex is not None and kind.generates:
        raise ConfigError("data.naflex is set on a captioner checkpoint; NaFlex prediction supports classifiers")
    preprocess = Preprocess(built.datamodule, net.encoder if kind.generates else net, naflex=naflex)
    temperature = None if kind.generates or label_sets else calibration_temperature(path, checkpoint, tta=tta)
    if temperature is not None and tome_r not in (None, own_tome_r):
        print(f"vitpipe: note: calibration.json not applied: fitted at model_tome_r={own_tome_r}, predicting at "
              f"{tome_r}", file=sys.stderr, flush=True)
        temperature = None
    thresholds = class_thresholds(path, checkpoint, built, threshold) if label_sets else None
    return Predictor(path=path, checkpoint=checkpoint, built=built, net=net, kind=kind, preprocess=preprocess,
                     tta=tta, temperature=temperature, thresholds=thresholds)


def captions(loaded: Predictor, x) -> list[str]:
    """A captioner's captions of a batch ``x`` (on its device), with the decoding settings the run validated with."""
    hp = loaded.built.module.hparams
    ids = loaded.net.generate(x, max_len=hp.max_gen_len, beam_size=hp.beam_size, length_penalty=hp.length_penalty)
    return loaded.built.module.tokenizer.batch_decode(ids)

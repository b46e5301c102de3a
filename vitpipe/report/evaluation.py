"""What ``scripts/eval.py`` adds around ``trainer.test``: the report, ``split``, ``calibrate``, ``tta``.

- ``split=test|val``: the split evaluated (metrics keyed ``test/*`` or ``val/*``); its report and
  predictions.csv go to the eval run directory, with the training run's history.csv copied beside
  them for the curves.
- ``calibrate=true``: fit one temperature on the validation split (Guo et al. 2017), test with it,
  report ``test/ece`` and ``test/nll`` after and ``*_uncalibrated`` before, and store
  ``calibration.json`` beside the checkpoint (scripts/predict.py applies it).
- ``tta=hflip``: average the softmax over each image and its mirror (logits become the log of the
  averaged probabilities, so loss, accuracy, ECE and the report all see the averaged prediction).
  It helps a network trained with flips; one that never saw a mirrored image (digits: a mirrored
  digit is another glyph) gets worse, so ``unseen_flip_warning`` says so before evaluating.

TTA and the temperature act through one forward hook on the evaluated network (``vitpipe.inference.tta``:
logits -> TTA -> temperature, the composition predict uses too), removed afterwards: the module and
its weights stay as loaded. calibration.json records the checkpoint (name in its run, size, step)
and the TTA setting the temperature was fitted with; predict applies it to that pair only.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig

from vitpipe.errors import ConfigError
from vitpipe.inference.tta import TTAS, at_test_time
from vitpipe.kinds import KINDS, kind_of_checkpoint
from vitpipe.report.calibration import (
    checkpoint_identity,
    expected_calibration_error,
    fit_temperature,
    nll,
    write_calibration,
)
from vitpipe.report.callback import ReportCallback
from vitpipe.report.history import HISTORY_FILE
from vitpipe.report.multilabel import best_f1_thresholds, write_thresholds
from vitpipe.report.predictions import MultilabelPredictions, Predictions, TestPredictions, evaluated_net
from vitpipe.run.paths import run_dir_of
from vitpipe.run.stored import config_of

SPLITS = ("test", "val")


@dataclass
class EvalOptions:
    split: str = "test"
    calibrate: bool = False
    tta: str = "none"
    tune_thresholds: bool = False


def eval_options(cfg: DictConfig) -> EvalOptions:
    """``split``, ``calibrate``, ``tta`` of an eval config, checked before anything loads."""
    split, calibrate, tta = cfg.get("split", "test"), cfg.get("calibrate", False), cfg.get("tta", "none")
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}; valid choices: {', '.join(SPLITS)}")
    if not isinstance(calibrate, bool):
        raise ConfigError(f"calibrate={calibrate!r}; use true or false")
    if tta in (None, False):
        tta = "none"
    if tta not in TTAS:
        raise ConfigError(f"tta={tta!r}; valid choices: {', '.join(TTAS)}")
    if calibrate and split != "test":
        raise ConfigError("calibrate=true fits the temperature on the validation split: evaluate split=test with it")
    tune = cfg.get("tune_thresholds", False)
    if not isinstance(tune, bool):
        raise ConfigError(f"tune_thresholds={tune!r}; use true or false")
    if tune and split != "val":
        raise ConfigError("tune_thresholds=true fits per-class thresholds on the split evaluated: use split=val "
                          "(thresholds tuned on the test split would make its F1 optimistic)")
    return EvalOptions(split, calibrate, tta, tune)


def multilabel_refusal(stored: dict | None, opts: EvalOptions) -> str | None:
    """Why ``opts`` cannot evaluate a checkpoint with this stored run config (one line), or None.

    Multi-label checkpoints: no temperature (calibrate) and no TTA (both are defined on the softmax here);
    ``tune_thresholds`` needs one."""
    if kind_of_checkpoint(stored) is not KINDS["multilabel"]:
        return ("tune_thresholds=true tunes per-class sigmoid thresholds: this checkpoint is not multi-label "
                "(module.task=multiclass); drop it") if opts.tune_thresholds else None
    if opts.calibrate:
        return ("calibrate=true fits a softmax temperature; this checkpoint is multi-label (module.task=multilabel): "
                "drop calibrate, or tune per-class thresholds with split=val tune_thresholds=true")
    if opts.tta != "none":
        return f"tta={opts.tta} averages softmax probabilities; this checkpoint is multi-label: use tta=none"
    return None


def unseen_flip_warning(stored: dict | None, tta: str) -> str | None:
    """One line when ``tta=hflip`` mirrors images for a network whose training never flipped one, else None.

    ``stored``: the run config a checkpoint keeps (``vitpipe.run.stored.config_of(checkpoint)``); training flips
    images only with ``data.augment`` (default on) and ``data.hflip`` both true. Eval and predict print it.
    """
    if tta != "hflip":
        return None
    data = (stored or {}).get("data") if isinstance(stored, dict) else None
    data = data if isinstance(data, dict) else {}
    augment, hflip = data.get("augment", True), data.get("hflip")
    if augment is not False and hflip is True:
        return None
    if augment is False:
        why = "data.augment=false"
    elif hflip is None:
        why = "its stored config records no flip augmentation (no data.hflip)"
    else:
        why = f"data.hflip={str(hflip).lower()}"
    return (f"tta=hflip averages each image with its mirror, but this checkpoint was trained without flips "
            f"({why}): mirrored images are new to it and usually lower its accuracy; use tta=none unless its "
            "classes look the same mirrored")


CARVE_KEYS = ("val_split", "test_split", "seed")  # how a data module carves validation/test images out of train


def carve_warning(stored: dict | None, given) -> str | None:
    """One line when eval's ``data=`` names the run's data module but carves its splits differently
    (``val_split``, ``test_split``, ``seed``): its validation or test images may then be training images."""
    data = (stored or {}).get("data") if isinstance(stored, dict) else None
    if not isinstance(data, dict) or given is None or given.get("_target_") != data.get("_target_"):
        return None
    differ = [k for k in CARVE_KEYS if k in given and given.get(k) != data.get(k)]
    if not differ:
        return None
    now = " ".join(f"data.{k}={given.get(k)}" for k in differ)
    run = " ".join(f"data.{k}={data.get(k)}" for k in differ)
    return (f"{now} carve the splits otherwise than the run did ({run}): images it trained on may be among those "
            f"evaluated; pass {run}")


def report_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """The callbacks of the eval Trainer: the report, written to the eval run directory."""
    return [ReportCallback(dirpath=str(cfg.paths.output_dir), split=eval_options(cfg).split)]


def evaluate_with_report(cfg: DictConfig, trainer: L.Trainer, module: L.LightningModule, datamodule,
                         ckpt_path, checkpoint: dict | None = None) -> dict[str, float]:
    """Evaluate the loaded ``module`` per ``cfg.split/calibrate/tta``; returns the metrics.

    ``trainer`` carries the ReportCallback (``report_callbacks``); the module holds the weights of
    ``ckpt_path``, whose loaded dict ``checkpoint`` identifies it in calibration.json (read again when None).
    """
    opts = eval_options(cfg)
    out, ckpt_path = Path(cfg.paths.output_dir), Path(ckpt_path)
    history = run_dir_of(ckpt_path) / HISTORY_FILE  # the run's per-epoch history, beside its checkpoints/
    if history.is_file() and history.parent.resolve() != out.resolve():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(history, out / HISTORY_FILE)
    report = next((c for c in trainer.callbacks if isinstance(c, ReportCallback)), None)
    net = evaluated_net(module)

    temperature, val = None, None
    if opts.calibrate:
        val = _predict_split(cfg, module, datamodule, "val", tta=opts.tta)
        temperature = fit_temperature(val.logits, val.target)
        if report is not None:
            report.title = f"temperature T = {temperature:.3f} (fitted on the validation split, NLL)"
    tuned = None
    if (report is not None and not opts.tune_thresholds
            and kind_of_checkpoint(_stored_config(checkpoint, ckpt_path)) is KINDS["multilabel"]):
        tuned = _tuned_thresholds(report, datamodule, net, ckpt_path, checkpoint)
    if opts.split == "test":
        _require_test_split(datamodule)
    with _as_test_split(datamodule, opts.split), at_test_time(net, tta=opts.tta, temperature=temperature):
        trainer.test(module, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/") and v.numel() == 1}

    result = report.result if report is not None else None
    if isinstance(result, MultilabelPredictions):
        if opts.tune_thresholds:
            metrics |= _tune_thresholds(result, datamodule, ckpt_path, checkpoint, opts.split)
        elif tuned is not None:
            metrics |= tuned_metrics(result, tuned)
        result = None  # no softmax: no NLL, no temperature
    if result is not None:
        metrics["test/nll"] = nll(result.logits, result.target)
    if temperature is not None and result is not None:
        raw = result.logits * temperature  # the same network without the temperature
        before = Predictions.from_logits(result.index, raw, result.target)
        metrics |= {"test/temperature": temperature, "test/nll_uncalibrated": nll(raw, result.target),
                    "test/ece_uncalibrated": before.ece()}
        if checkpoint is None:
            from vitpipe.run.stored import load_checkpoint

            checkpoint = load_checkpoint(ckpt_path)
        write_calibration(
            ckpt_path.parent, temperature, identity=checkpoint_identity(ckpt_path, checkpoint), tta=opts.tta,
            fitted_on="val",
            val_nll_before=nll(val.logits, val.target), val_nll_after=nll(val.logits, val.target, temperature),
            val_ece_before=val.ece(), val_ece_after=_ece(val.logits / temperature, val.target),
            test_nll_before=metrics["test/nll_uncalibrated"], test_nll_after=metrics["test/nll"],
            test_ece_before=metrics["test/ece_uncalibrated"], test_ece_after=metrics.get("test/ece"),
        )
    if opts.split != "test":
        metrics = {f"{opts.split}/{k.removeprefix('test/')}": v for k, v in metrics.items()}
    return metrics


def _tune_thresholds(result: MultilabelPredictions, datamodule, ckpt_path: Path, checkpoint: dict | None,
                     split: str) -> dict[str, float]:
    """Per-class F1-maximising thresholds on ``result`` -> thresholds.json beside the checkpoint; returns
    ``test/f1_macro_tuned`` (the macro F1 at them, on the split they were fitted on)."""
    from vitpipe.run.stored import load_checkpoint

    scores, target = result.scores.numpy(), result.target.numpy()
    names = list(getattr(datamodule, "class_names", None) or [str(i) for i in range(scores.shape[1])])
    thresholds, f1 = best_f1_thresholds(scores, target, default=result.threshold)
    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(ckpt_path)
    write_thresholds(ckpt_path.parent, names, thresholds, f1, identity=checkpoint_identity(ckpt_path, checkpoint),
                     fitted_on=split)
    return {"test/f1_macro_tuned": float(f1.mean())}


def _stored_config(checkpoint: dict | None, ckpt_path: Path) -> dict | None:
    if checkpoint is None:
        from vitpipe.run.stored import load_checkpoint

        checkpoint = load_checkpoint(ckpt_path)
    return config_of(checkpoint)


def _tuned_thresholds(report, datamodule, net, ckpt_path: Path, checkpoint: dict | None):
    """The per-class thresholds of a thresholds.json fitted on this checkpoint (None without one): the
    report and predictions.csv's ``predicted`` column then use them, as predict does (a note says so)."""
    import sys

    from vitpipe.report.multilabel import find_thresholds
    from vitpipe.run.stored import load_checkpoint

    checkpoint = checkpoint if checkpoint is not None else load_checkpoint(ckpt_path)
    names = checkpoint.get("class_names") or getattr(datamodule, "class_names", None) or []
    c = int(net.num_classes)
    names = [str(n) for n in names] if len(names) == c else [str(i) for i in range(c)]  # as predict names them
    thresholds, note = find_thresholds(ckpt_path, checkpoint, names)
    if note:
        print(f"vitpipe eval: note: {note}", file=sys.stderr)
    if thresholds is None:
        return None
    report.thresholds, report.threshold_source = thresholds, "thresholds.json"
    return thresholds


def tuned_metrics(result: MultilabelPredictions, thresholds) -> dict[str, float]:
    """F1 (macro, micro), precision and recall (macro) and example-based F1 of ``score >= t`` at per-class
    thresholds ``t`` (C,), as ``test/<metric>_tuned`` (sklearn, zero_division=0)."""
    from sklearn.metrics import f1_score, precision_score, recall_score

    target = result.target.numpy()
    pred = (result.scores.numpy() >= np.asarray(thresholds, dtype=np.float64)).astype(np.int64)
    kw = dict(zero_division=0)
    return {"test/f1_macro_tuned": float(f1_score(target, pred, average="macro", **kw)),
            "test/f1_micro_tuned": float(f1_score(target, pred, average="micro", **kw)),
            "test/precision_macro_tuned": float(precision_score(target, pred, average="macro", **kw)),
            "test/recall_macro_tuned": float(recall_score(target, pred, average="macro", **kw)),
            "test/f1_example_tuned": float(f1_score(target, pred, average="samples", **kw))}


def _require_test_split(datamodule) -> None:
    """ConfigError when the data has no test images (an image folder without test/ and data.test_split=0):
    the validation split is never reported as test."""
    if not hasattr(datamodule, "data_test"):
        return
    datamodule.setup("test")
    if datamodule.data_test is not None and len(datamodule.data_test) == 0:
        raise ConfigError("this data has no test split (an image folder without test/ and data.test_split=0?); "
                          "evaluate split=val for the validation split (reported as val/*), or give it a test split")


@contextlib.contextmanager
def _as_test_split(datamodule, split: str):
    """Let ``trainer.test`` read ``split``: the data module's test set is swapped for it meanwhile."""
    if split == "test":
        yield
        return
    datamodule.setup("fit")
    if datamodule.data_val is None or len(datamodule.data_val) == 0:
        raise ConfigError(f"split={split}: this data has no validation images (data.val_split=0?)")
    saved, datamodule.data_test = datamodule.data_test, datamodule.data_val
    try:
        yield
    finally:
        datamodule.data_test = saved


def _predict_split(cfg: DictConfig, module, datamodule, split: str, *, tta: str) -> Predictions:
    """Logits of a whole split, through a Trainer of the eval config (devices, precision) that
    writes nothing."""
    from vitpipe.config.build import build_trainer

    collector = TestPredictions()
    trainer = build_trainer(cfg.trainer, logger=False, callbacks=[collector],
                                  enable_checkpointing=False, enable_progress_bar=False)
    with _as_test_split(datamodule, split), at_test_time(evaluated_net(module), tta=tta):
        trainer.test(module, datamodule=datamodule, verbose=False)
    if collector.result is None:
        raise ConfigError(f"split={split}: the module produced no class predictions (not a classifier?)")
    return collector.result


def _ece(logits: torch.Tensor, target: torch.Tensor) -> float:
    probs = logits.softmax(-1)
    return expected_calibration_error(probs.max(-1).values, probs.argmax(-1) == target)

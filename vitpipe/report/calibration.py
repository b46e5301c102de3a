"""Calibration: expected calibration error, reliability bins, temperature scaling.

ECE (Naeini et al. 2015; Guo et al. 2017): split the top-1 confidences into equal-width bins and
average |accuracy - confidence| per bin, weighted by the share of samples in it. Temperature scaling
(Guo et al. 2017, section 4.2): one scalar T > 0 divides all logits; it is fitted on the validation
split by minimising the NLL, so the argmax (the predictions) never changes, only their confidence.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.functional.classification import binary_calibration_error

from vitpipe.run.files import atomic_write_text
from vitpipe.run.jsonfiles import read_json
from vitpipe.run.paths import run_dir_of

N_BINS = 15
CALIBRATION_FILE = "calibration.json"  # beside the checkpoint; predict applies it to that checkpoint and TTA only


def expected_calibration_error(confidence: Tensor, correct: Tensor, n_bins: int = N_BINS) -> float:
    """ECE (L1) of top-1 confidences (N,) in [0, 1] and whether each top-1 was right (N,) bool.

    The same number as torchmetrics' ``MulticlassCalibrationError(n_bins, norm="l1")`` on the full
    probabilities: that metric only looks at the top-1 confidence and its correctness.
    """
    if confidence.numel() == 0:
        return 0.0
    return float(binary_calibration_error(confidence.double(), correct.long(), n_bins=n_bins, norm="l1"))


def reliability_bins(confidence: Tensor, correct: Tensor, n_bins: int = N_BINS) -> dict[str, Tensor]:
    """Per equal-width bin: ``count``, mean ``confidence`` and ``accuracy`` (0 where empty), (n_bins,) each.

    Bins are [k/n, (k+1)/n) as in torchmetrics, with a confidence of exactly 1.0 in the last bin.
    """
    conf = confidence.double()
    idx = (conf * n_bins).floor().long().clamp(0, n_bins - 1)  # (N,)
    count = torch.bincount(idx, minlength=n_bins).double()
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    acc_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct.double())
    safe = count.clamp(min=1)
    return {"count": count, "confidence": conf_sum / safe, "accuracy": acc_sum / safe,
            "edges": torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)}


def nll(logits: Tensor, target: Tensor, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of ``target`` (N,) under ``softmax(logits / T)``, logits (N, C)."""
    return float(F.cross_entropy(logits.double() / temperature, target))


def fit_temperature(logits: Tensor, target: Tensor, *, max_iter: int = 100) -> float:
    """The T > 0 minimising NLL(softmax(logits / T), target): LBFGS on log T (keeps T positive).

    logits: (N, C) of the VALIDATION split (fitting on the test split would report a biased ECE).
    """
    # clones: tensors made under trainer.test's inference mode cannot enter autograd
    logits, target = logits.detach().clone().double(), target.detach().clone()
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(logits / log_t.exp(), target)
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp())


# --------------------------------------------------------------------------- calibration.json
#
# A temperature belongs to one checkpoint and one TTA setting: fitted on best.ckpt's mirror-averaged
# logits it means nothing for last.ckpt or for one view. calibration.json therefore records which
# checkpoint it was fitted on, by an identity that survives copying or moving the run directory: the
# file's name relative to the run (``checkpoints/epoch_029.ckpt``), its size in bytes and the
# ``global_step`` stored inside it (a later save under the same name, e.g. last.ckpt, has another step).
# No absolute path and no modification time: both change with ``cp -r``.


def checkpoint_identity(ckpt_path: Path, checkpoint: dict) -> dict:
    """``{"checkpoint": name relative to its run, "checkpoint_bytes": size, "global_step": step or None}``."""
    ckpt_path = Path(ckpt_path)
    name = f"checkpoints/{ckpt_path.name}" if ckpt_path.parent.name == "checkpoints" else ckpt_path.name
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    return {"checkpoint": name, "checkpoint_bytes": ckpt_path.stat().st_size,
            "global_step": step if isinstance(step, int) and not isinstance(step, bool) else None}


def write_calibration(directory: Path, temperature: float, *, identity: dict, tta: str, **extra) -> Path:
    """``<directory>/calibration.json`` = {"temperature": T, the checkpoint's identity, "tta", **extra}
    (written atomically)."""
    path = Path(directory) / CALIBRATION_FILE
    record = {"temperature": temperature, **identity, "tta": tta, **extra}
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return path


def _read(path: Path) -> dict:
    from vitpipe.errors import ConfigError

    try:
        record = read_json(path)  # bounded: a file nested 1,000 deep is one line, not a RecursionError
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix or remove it") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} holds {type(record).__name__}, not an object with a temperature; fix or remove it")
    t = record.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0):
        raise ConfigError(f"{path}: temperature={t!r} must be a finite number > 0; fix or remove the file")
    return record


def _mismatch(record: dict, identity: dict, tta: str) -> str | None:
    """Why ``record`` was not fitted on the checkpoint ``identity`` with ``tta``, or None when it was."""
    if not all(k in record for k in ("checkpoint", "checkpoint_bytes", "global_step", "tta")):
        return ("it does not record which checkpoint and TTA it was fitted on (written by hand or by an older "
                "vitpipe); run scripts/eval.py calibrate=true on this checkpoint to fit one")
    if record["checkpoint"] != identity["checkpoint"]:
        return f"it was fitted on {record['checkpoint']}, not {identity['checkpoint']}"
    if (record["checkpoint_bytes"], record["global_step"]) != (identity["checkpoint_bytes"], identity["global_step"]):
        return (f"it was fitted on another {identity['checkpoint']} (step {record['global_step']}, "
                f"{record['checkpoint_bytes']} bytes; this one: step {identity['global_step']}, "
                f"{identity['checkpoint_bytes']} bytes)")
    if record["tta"] != tta:
        return f"it was fitted with tta={record['tta']}, this run uses tta={tta}"
    return None


def find_temperature(ckpt_path: Path, checkpoint: dict, *, tta: str) -> tuple[float | None, str | None]:
    """The temperature fitted on exactly this checkpoint with this TTA setting, and a line saying where it
    came from or why none was applied: (None, None) when there is no calibration.json to consider.

    Looked up beside the checkpoint (where eval writes it), then in its run directory (an older place).
    """
    ckpt_path = Path(ckpt_path)
    run = run_dir_of(ckpt_path)
    identity = checkpoint_identity(ckpt_path, checkpoint)
    refusal = None
    for folder in dict.fromkeys((ckpt_path.parent, run)):
        path = folder / CALIBRATION_FILE
        if not path.is_file():
            continue
        record = _read(path)
        if record.get("temperature") is None:
            continue
        why = _mismatch(record, identity, tta)
        if why is None:
            t = float(record["temperature"])
            return t, f"temperature {t:g} from {path}"
        refusal = refusal or f"{path}: its temperature {record['temperature']:g} is not applied: {why}"
    return None, refusal


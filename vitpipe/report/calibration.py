"""Calibration: expected calibration error, reliability bins, temperature scaling.

ECE (Naeini et al. 2015; Guo et al. 2017): split the top-1 confidences into equal-width bins and
average |accuracy - confidence| per bin, weighted by the share of samples in it. Temperature scaling
(Guo et al. 2017, section 4.2): one scalar T > 0 divides all logits; it is fitted on the validation
split by minimising the NLL, so the argmax (the predictions) never changes, only their confidence.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.functional.classification import binary_calibration_error

from vitpipe.runinfo import atomic_write_text

N_BINS = 15
CALIBRATION_FILE = "calibration.json"  # beside the checkpoint; scripts/predict.py applies it


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


def write_calibration(directory: Path, temperature: float, **extra) -> Path:
    """``<directory>/calibration.json`` = {"temperature": T, **extra} (written atomically)."""
    path = Path(directory) / CALIBRATION_FILE
    atomic_write_text(path, json.dumps({"temperature": temperature, **extra}, indent=2, sort_keys=True) + "\n")
    return path


def read_temperature(directory: Path) -> float | None:
    """The temperature of ``<directory>/calibration.json``, or None when there is none."""
    import math

    from vitpipe.errors import ConfigError

    path = Path(directory) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        t = json.loads(path.read_text()).get("temperature")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"cannot read {path}: {e}; fix or remove it") from None
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ConfigError(f"{path}: temperature={t!r} must be a finite number > 0; fix or remove the file")
    return float(t)

"""Class probabilities of a classifier: logits -> TTA -> temperature -> softmax (eval's composition,
``vitpipe.inference.tta``), or a sigmoid per class for a multi-label one (the task kind's ``probabilities``);
and the temperature of a ``calibration.json`` fitted on the checkpoint (Guo et al. 2017). Predict, serve and demo all answer
through ``class_probs``, so their probabilities cannot drift apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch import Tensor

from vitpipe.data.preprocess import hflip_patches
from vitpipe.errors import ConfigError
from vitpipe.inference.images import batch_len
from vitpipe.inference.tta import tta_logits
from vitpipe.kinds import KINDS, TaskKind


def class_probs(net, x: Tensor, *, kind: TaskKind | None = None, tta: str = "none",
                temperature: float | None = None) -> Tensor:
    """Probabilities (B, classes) of a classifier of task ``kind`` (default multi-class): logits -> TTA ->
    temperature (Guo et al. 2017) -> ``kind.probabilities`` (softmax), eval's composition
    (``vitpipe.inference.tta.tta_logits``). ``x``: images (B, C, H, W) or a NaFlex patch dict (mirrored per
    image on its own grid for ``tta=hflip``). A multi-label kind gives the sigmoid of each logit (no TTA, no
    temperature: ``load_predictor`` refuses them for such checkpoints)."""
    kind = kind or KINDS["multiclass"]
    logits = net(x)
    if not (isinstance(logits, Tensor) and logits.ndim == 2 and logits.shape[0] == batch_len(x)):
        what = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ConfigError(f"predict: {type(net).__name__} returns {what}, not logits (B, classes); "
                          "predict handles classifiers and captioners")
    flipped = (lambda: net(hflip_patches(x, net.patch_size))) if isinstance(x, dict) else (lambda: net(x.flip(-1)))
    return kind.probabilities(tta_logits(logits, flipped, tta=tta, temperature=temperature).float())


def calibration_temperature(ckpt_path: Path, checkpoint: dict, *, tta: str = "none") -> float | None:
    """The temperature of a ``calibration.json`` (beside the checkpoint, or in its run directory) fitted
    on this checkpoint with this ``tta``; else None, with one line on stderr when a file was passed over."""
    from vitpipe.report.calibration import find_temperature

    temperature, line = find_temperature(ckpt_path, checkpoint, tta=tta)
    if temperature is None and line:
        print(f"vitpipe: note: {line}", file=sys.stderr, flush=True)
    return temperature

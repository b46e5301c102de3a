"""The one interface every task kind implements (timm's model families share layers but are separate
classes; so are our task kinds). A kind says what differs between tasks: what selects it in a config,
what a run of it is called, its loss, its metrics per split, how logits become probabilities, how
an exported file's outputs are read. Things of higher layers (report sections, prediction rows) are
tables keyed by ``kind.name`` in the one module that owns them, never re-decided by a flag.

A kind holds no state: the registry keeps one instance each, and ``kind is other`` compares kinds.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor
from torchmetrics import Metric


class TaskKind:
    """What one task does differently. Subclasses set the class attributes; classifier kinds fill in
    the methods below, which other kinds refuse (a captioner has no class probabilities)."""

    name: ClassVar[str]  # the registry key; for classifiers also what ``module.task`` says
    words: ClassVar[str]  # what a run of this kind is called in messages: "multi-label classifier"
    module_target: ClassVar[str]  # the LightningModule conf/module/<group>.yaml instantiates
    classifies: ClassVar[bool] = False  # logits (B, C) over named classes: predictions.csv, report/, export
    generates: ClassVar[bool] = False  # text out of ``net.generate`` (captions), not logits
    target_ndim: ClassVar[int | None] = None  # a classifier batch's targets: 1 (B,) class indices, 2 (B, C) multi-hot
    score: ClassVar[str | None] = None  # the validation score kept best of (val/<score>, val/<score>_best)

    # ---- choosing: a config's module section <-> kind

    @classmethod
    def selected_by(cls, module: dict) -> bool:
        """Whether a run config's ``module`` section (composed or stored, as a plain dict) trains this kind."""
        return _class_name(module.get("_target_")) == _class_name(cls.module_target)

    def module_config(self) -> dict:
        """The ``module`` keys that select this kind, as a stored config holds them."""
        return {"_target_": self.module_target}

    # ---- classifiers: what differs between one class per image and a set of labels

    def probabilities(self, logits: Tensor) -> Tensor:
        """(B, C) probabilities of logits (B, C): softmax over classes, or a sigmoid per class."""
        raise TypeError(f"a {self.words} gives no class probabilities")

    def check_loss(self, loss: str | None, distill: dict | None) -> str:
        """The loss this kind trains with for ``module.loss`` (null: the kind's own); ConfigError naming a
        bad combination."""
        raise TypeError(f"a {self.words} has no classification loss")

    def loss_settings(self, loss: str, asl: dict | None) -> dict | None:
        """The checked settings of ``loss`` (ASL's gamma_neg, gamma_pos, clip), or None when it has none."""
        return None

    def train_loss(self, logits: Tensor, target: Tensor, *, loss: str, settings: dict | None, smoothing: float,
                   weight: Tensor | None) -> Tensor:
        """The training loss of logits (B, C) against the batch's (or mixup's) targets; ``weight``: per-class
        weights (multi-class) or BCE's ``pos_weight`` (multi-label)."""
        raise TypeError(f"a {self.words} has no classification loss")

    def eval_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """The validation/test loss: unweighted, unsmoothed, mean over the batch."""
        raise TypeError(f"a {self.words} has no classification loss")

    def split_metrics(self, num_classes: int, threshold: float) -> Metric:
        """A fresh metric collection for one evaluation split (``val``, ``test``)."""
        raise TypeError(f"a {self.words} has no classification metrics")

    def epoch_logs(self, prefix: str, scores: dict, class_names: list[str] | None = None) -> tuple[dict, dict]:
        """The keys one evaluation epoch logs from ``split_metrics(...).compute()``: (shown on the progress
        bar, the rest). ``scores[self.score]`` is also kept best of as ``<prefix>/<score>_best``."""
        raise TypeError(f"a {self.words} has no classification metrics")

    def train_metric(self, num_classes: int) -> Metric | None:
        """The metric logged as ``train/<score>`` while training, or None."""
        return None

    onnx_outputs: ClassVar[str] = ""  # how an exported file's logits are read, in its metadata

    def __repr__(self) -> str:
        return f"<task kind {self.name}>"


def _class_name(target) -> str:
    # conf/ names ImageClassifier by its package (vitpipe.lit.ImageClassifier), older runs by its module
    # (vitpipe.lit.classifier.ImageClassifier): the class is what picks the kind, as config/ checks it
    return str(target or "").rsplit(".", 1)[-1]

"""Multi-label scores per split: mAP (macro, micro, per class), F1/precision/recall at a threshold,
example-based F1, as DDP-safe torchmetrics.

Keys of ``MultilabelScores.compute()`` (the classifier logs them as ``val/<key>``, ``test/<key>``):
``map`` (macro AP: the mean over classes of each class's average precision), ``map_micro`` (AP of all
(image, class) pairs pooled), ``ap`` (C,) per class, ``f1_macro``, ``f1_micro``, ``precision_macro``,
``precision_micro``, ``recall_macro``, ``recall_micro`` (probabilities >= threshold count as
predicted), ``f1_example`` (the mean over images of 2 |P & T| / (|P| + |T|); an image with neither
a true nor a predicted label scores 0, sklearn's ``f1_score(average="samples")`` with zero_division=0).
AP follows sklearn's ``average_precision_score`` (step-wise, no interpolation).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import (
    MultilabelAveragePrecision,
    MultilabelF1Score,
    MultilabelPrecision,
    MultilabelRecall,
)


class ExampleF1(Metric):
    """Example-based F1 (Godbole & Sarawagi 2004): per-image F1 of the predicted label set, averaged."""

    full_state_update = False

    def __init__(self, threshold: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.threshold = threshold
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, logits: Tensor, target: Tensor) -> None:
        pred = torch.sigmoid(logits) >= self.threshold  # (B, C)
        true = target > 0.5
        inter = (pred & true).sum(-1).double()
        denom = (pred.sum(-1) + true.sum(-1)).double()
        self.total += torch.where(denom > 0, 2 * inter / denom.clamp(min=1), 0.0).sum()
        self.count += len(target)

    def compute(self) -> Tensor:
        return (self.total / self.count.clamp(min=1)).float()


class MultilabelScores(MetricCollection):
    """Every multi-label score of one split; ``update(logits (B, C), target multi-hot (B, C))``."""

    def __init__(self, num_labels: int, threshold: float = 0.5) -> None:
        at = {"num_labels": num_labels, "threshold": threshold}
        super().__init__({
            "ap": MultilabelAveragePrecision(num_labels, average="none", thresholds=None),
            "map_micro": MultilabelAveragePrecision(num_labels, average="micro", thresholds=None),
            **{f"{name}_{avg}": cls(**at, average=avg) for name, cls in (
                ("f1", MultilabelF1Score), ("precision", MultilabelPrecision), ("recall", MultilabelRecall))
               for avg in ("macro", "micro")},
            "f1_example": ExampleF1(threshold),
        })  # fmt: skip

    def update(self, logits: Tensor, target: Tensor) -> None:
        # torchmetrics' multilabel metrics take logits (a sigmoid is applied to values outside [0, 1])
        # and int targets; the ExampleF1 above takes the same pair
        super().update(logits.float(), target.round().long())

    def compute(self) -> dict[str, Tensor]:
        scores = super().compute()
        ap = scores["ap"]
        scores["map"] = ap[~torch.isnan(ap)].mean() if (~torch.isnan(ap)).any() else ap.new_tensor(float("nan"))
        return scores

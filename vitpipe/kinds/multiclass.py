"""Multi-class classification: one class per image, softmax cross-entropy on class indices (B,),
top-1/top-5 accuracy; the default of ``module=classifier`` (``module.task=multiclass``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from vitpipe.errors import ConfigError
from vitpipe.kinds.base import TaskKind


class MultiClass(TaskKind):
    name = "multiclass"
    words = "classifier"
    module_target = "vitpipe.lit.ImageClassifier"
    classifies = True
    target_ndim = 1
    score = "acc"
    onnx_outputs = "softmax over classes for probabilities"

    @classmethod
    def selected_by(cls, module: dict) -> bool:
        return super().selected_by(module) and module.get("task", cls.name) == cls.name

    def module_config(self) -> dict:
        return {**super().module_config(), "task": self.name}

    def probabilities(self, logits: Tensor) -> Tensor:
        return logits.softmax(-1)

    def check_loss(self, loss: str | None, distill: dict | None) -> str:
        if loss not in (None, "ce"):
            raise ConfigError(f"module.loss={loss!r} is a multi-label loss; set module.task=multilabel, "
                              "or module.loss=null (cross-entropy)")
        return "ce"

    def train_loss(self, logits, target, *, loss, settings, smoothing, weight):
        return F.cross_entropy(logits, target, weight=weight, label_smoothing=smoothing)

    def eval_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits, target)

    def split_metrics(self, num_classes: int, threshold: float) -> Metric:
        return MetricCollection({"acc": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                                 "acc_top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")})

    def epoch_logs(self, prefix: str, scores: dict, class_names: list[str] | None = None) -> tuple[dict, dict]:
        return {f"{prefix}/acc": scores["acc"], f"{prefix}/acc_top5": scores["acc_top5"]}, {}

    def train_metric(self, num_classes: int) -> Metric:
        return MulticlassAccuracy(num_classes, top_k=1, average="micro")


"""Multi-label classification (``module.task=multilabel``): a set of labels per image, one sigmoid per
class on multi-hot targets (B, C), BCE or ASL (vitpipe.kinds.losses), mAP/F1/precision/recall
(vitpipe.metrics.multilabel); no distillation (a teacher's soft labels are one softmax over classes)."""

from __future__ import annotations

import re

import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from vitpipe.errors import ConfigError
from vitpipe.kinds.base import TaskKind
from vitpipe.kinds.losses import check_loss, multilabel_loss
from vitpipe.metrics.multilabel import MultilabelScores


class MultiLabel(TaskKind):
    name = "multilabel"
    words = "multi-label classifier"
    module_target = "vitpipe.lit.ImageClassifier"
    classifies = True
    target_ndim = 2
    score = "map"
    onnx_outputs = "a sigmoid per class (multi-label)"

    @classmethod
    def selected_by(cls, module: dict) -> bool:
        return super().selected_by(module) and module.get("task") == cls.name

    def module_config(self) -> dict:
        return {**super().module_config(), "task": self.name}

    def probabilities(self, logits: Tensor) -> Tensor:
        return logits.sigmoid()  # each class on its own: the scores need not sum to 1

    def check_loss(self, loss: str | None, distill: dict | None) -> str:
        if distill is not None:
            raise ConfigError("module.task=multilabel cannot distill (the teacher's soft labels are one softmax "
                              "over classes); set module.distill.teacher=null")
        return "bce" if loss is None else loss

    def loss_settings(self, loss: str, asl: dict | None) -> dict:
        """The ASL settings (gamma_neg, gamma_pos, clip) for ``loss``; ConfigError naming a bad value."""
        return check_loss(loss, asl)

    def train_loss(self, logits, target, *, loss, settings, smoothing, weight):
        return multilabel_loss(logits, target, loss=loss, asl=settings, smoothing=smoothing, pos_weight=weight)

    def eval_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(logits, target.float())

    def split_metrics(self, num_classes: int, threshold: float) -> Metric:
        return MultilabelScores(num_classes, threshold=float(threshold))

    def epoch_logs(self, prefix: str, scores: dict, class_names: list[str] | None = None) -> tuple[dict, dict]:
        # every scalar of MultilabelScores; mAP on the progress bar; per-class AP at test only (one key a class)
        rest = {f"{prefix}/{k}": v for k, v in scores.items() if k not in ("map", "ap")}
        if prefix == "test":
            rest.update(per_class_ap(scores["ap"], class_names, prefix))
        return {f"{prefix}/map": scores["map"]}, rest


def per_class_ap(ap: Tensor, names: list[str] | None, prefix: str = "test") -> dict:
    """``<prefix>/ap/<class>`` per class (names made key-safe: other characters become ``_``; the
    index when names are unknown); NaN for a class without positives in the split."""
    keys = [re.sub(r"[^0-9A-Za-z_.-]", "_", str(n)) for n in names] if names and len(names) == len(ap) else None
    return {f"{prefix}/ap/{keys[c] if keys else c}": ap[c] for c in range(len(ap))}

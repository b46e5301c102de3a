"""ImageClassifier: the LightningModule for classification.

It receives a built ``net`` and partial optimizer/scheduler from the config (lightning-hydra-
template style) and owns loss, metrics, mixup/cutmix and EMA; the model owns its architecture and
its weight-decay exclusions.

One network is trained: ``self.net`` (checkpoint keys ``net.*``). With ``ema_decay`` the module
also keeps ``self.ema`` (timm ``ModelEmaV3``, keys ``ema.module.*``), an averaged copy of its
weights. ``eval_net`` names the network validation and test run: the EMA copy when there is one.

``task`` picks the task kind once (vitpipe.kinds, ``self.kind``), which owns what differs: ``multilabel``
trains one sigmoid per class on multi-hot targets (B, C) (BCE or ASL; mAP, F1, precision, recall);
``multiclass`` (the default) is cross-entropy on class indices (B,) with top-1/top-5 accuracy.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric

from vitpipe.config.checks import check_precompute
from vitpipe.data.fast import TensorImageDataset
from vitpipe.data.naflex import loss_scale
from vitpipe.errors import ConfigError
from vitpipe.kinds.registry import classifier_kind
from vitpipe.lit.distill import (
    cached_targets,
    check_distill,
    combine,
    load_teacher,
    targets_key,
    teacher_input,
    teacher_targets,
)
from vitpipe.lit.finetune import FineTuning, add_probe_bn, check_finetune
from vitpipe.lit.footprint import Footprint
from vitpipe.lit.nonfinite import NonFiniteGuard, NonFiniteLossError, check_policy
from vitpipe.lit.optim import ConfiguredOptimizers, check_layer_decay
from vitpipe.lit.reload import LoadsStoredRun
from vitpipe.models.lora import add_lora, lora_settings

__all__ = ["ImageClassifier", "NonFiniteLossError"]


class ImageClassifier(LoadsStoredRun, NonFiniteGuard, ConfiguredOptimizers, L.LightningModule):
    """Cross-entropy classification with top-1/top-5 accuracy per split; with ``task="multilabel"``
    a sigmoid per class with mAP, F1, precision and recall (``vitpipe.metrics.multilabel``).

    Args:
        net: the network, ``net(x) -> logits (B, num_classes)``.
        optimizer: a partial optimizer (``_partial_: true``), called on parameter groups.
        scheduler: a partial timm scheduler, called with ``t_initial`` and ``warmup_t`` in steps.
        warmup_fraction: fraction of all optimizer steps spent warming up.
        label_smoothing: Szegedy et al. 2016; passed to timm's Mixup when mixup is on.
        mixup: kwargs of ``timm.data.Mixup`` (mixup_alpha, cutmix_alpha, ...), or None.
        ema_decay: keep an EMA of the weights (timm ModelEmaV3) and validate/test with it; updated
            once per applied optimizer step (``ema_decay`` is the decay per step, whatever
            ``accumulate_grad_batches``), the first update a copy.
        compile: ``torch.compile`` the network in place (``nn.Module.compile``) when a Trainer
            starts: the module tree is unchanged, so checkpoints hold plain ``net.*`` keys.
        nonfinite: what a NaN/inf loss does (``vitpipe.lit.nonfinite``): ``"error"`` stops the run
            naming the step, ``"skip"`` drops that optimizer step on every rank and counts it in
            ``train/skipped_batches``.
        class_weights: weight the training cross-entropy per class: ``"balanced"`` (inverse class
            frequency of the training split, ``n / (C * n_c)``, vitpipe.data.balance) or one
            weight per class; None: unweighted. Validation/test losses stay unweighted.
        layer_decay: layer-wise lr decay (BEiT/MAE fine-tuning): block i trains at lr *
            decay^(depth - i), the stem at decay^(depth + 1), final norm and head at lr
            (``vitpipe.lit.optim``); None: one lr for all.
        finetune: ``full``, ``linear_probe`` (the head alone, encoder frozen), ``head_then_full``
            (the head alone for ``finetune_warmup_epochs`` epochs, then everything) or ``lora`` (low-rank
            adapters and the head; ``net`` is adapted in place here); see ``vitpipe.lit.finetune``.
        lora: ``finetune=lora``'s settings (``vitpipe.models.lora``): ``r`` (16), ``alpha`` (16: the
            adapters scale by alpha / r), ``dropout`` (0), ``targets`` (the linear layers' names:
            ``[qkv, fc1, fc2]``). Ignored by the other modes.
        distill: knowledge distillation from a frozen teacher (``vitpipe.lit.distill``): ``teacher``
            (null: off; a vitpipe checkpoint, a timm export folder, a timm name, a weights file with
            ``arch``), ``type`` soft | hard, ``alpha``, ``tau``. With ``model.dist_token`` the
            distillation head learns from the teacher, the class head from the labels (DeiT).
        task: ``multiclass`` (softmax cross-entropy on class indices) or ``multilabel`` (a sigmoid per
            class on multi-hot targets; no distillation). With ``multilabel``, ``label_smoothing`` moves
            each target towards 0.5 (timm's ``BinaryCrossEntropy(smooth_dense=True)``), mixup mixes the
            multi-hot targets (timm's ``Mixup(multi_label=True)``) and ``class_weights`` are BCE's
            ``pos_weight`` (``balanced``: negatives / positives per class of the training split).
        loss: null (the task's: ``ce`` | ``bce``), or ``asl`` (multi-label; Ridnik et al. 2021) with
            ``asl: {gamma_neg, gamma_pos, clip}`` (vitpipe.kinds.losses).
        threshold: multi-label F1/precision/recall count a class as predicted at sigmoid >= threshold.
    """

    def __init__(self, net: nn.Module, optimizer, scheduler=None, *, warmup_fraction: float = 0.05,
                 label_smoothing: float = 0.0, mixup: dict | None = None, ema_decay: float | None = None,
                 compile: bool = False, nonfinite: str = "error",
                 class_weights: str | list[float] | None = None, layer_decay: float | None = None,
                 finetune: str = "full", finetune_warmup_epochs: int = 0, distill: dict | None = None,
                 probe_bn: bool = False, task: str = "multiclass", loss: str | None = None,
                 asl: dict | None = None, threshold: float = 0.5, lora: dict | None = None) -> None:
        super().__init__()
        check_policy(nonfinite)
        self.distill = check_distill(distill)
        self.kind = classifier_kind(task)  # chosen once; the loss, metrics and logs below ask it
        self.loss_name = self.kind.check_loss(loss, self.distill)
        self.asl = self.kind.loss_settings(self.loss_name, asl)
        if not 0.0 < float(threshold) < 1.0:
            raise ConfigError(f"module.threshold={threshold!r}: a probability in (0, 1), e.g. 0.5")
        # The teacher lives outside the module tree (a plain attribute): no optimizer, checkpoint or
        # DDP wrapper sees it, and train()/eval() never switch it out of eval mode. Loaded in setup("fit").
        object.__setattr__(self, "teacher", None)
        check_finetune(finetune, finetune_warmup_epochs)
        check_layer_decay(layer_decay, net)
        # (C,) or None (multi-label: BCE's pos_weight); "balanced" is filled in setup("fit"), once the training labels are known
        self.register_buffer("class_weight", _class_weight(class_weights, net.num_classes), persistent=False)
        if type(probe_bn) is not bool:  # 1 or "true" from a hand-written config: say so
            raise ValueError(f"module.probe_bn={probe_bn!r}: expected true or false")
        if probe_bn:
            add_probe_bn(net)  # before the EMA copy below; a checkpoint's rebuild comes through here too
        if finetune == "lora":  # also before the EMA copy; a rebuild adapts too, so the stored keys fit
            add_lora(net, lora_settings(lora))
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        n = net.num_classes
        self.mixup = None
        if mixup:
            from timm.data import Mixup

            self.mixup = Mixup(**{"label_smoothing": label_smoothing, **dict(mixup)}, num_classes=n,
                               multi_label=self.kind.target_ndim == 2)  # multi-hot targets mixed, smoothed to 0.5
        self.ema = None
        if ema_decay:
            from timm.utils import ModelEmaV3

            self.ema = ModelEmaV3(net, decay=ema_decay)  # a deep copy, made before any compile
        self.skipped_batches = 0
        self.naflex = None  # the data module's NaFlexConfig when it feeds patch dicts (setup("fit"))
        self.train_acc = self.kind.train_metric(n)
        self.val_metrics, self.test_metrics = (self.kind.split_metrics(n, float(threshold)) for _ in range(2))
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()  # of the monitored score: val/acc, or val/map (multi-label)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @property
    def eval_net(self) -> nn.Module:
        """The network validation and test run: the EMA copy when one is kept, else ``net``."""
        return self.ema.module if self.ema is not None else self.net

    def configure_callbacks(self):
        mode = self.hparams.get("finetune", "full")
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        # trainable parameters at fit start, peak memory at its end; fit only (a test after it would replace it)
        footprint = [Footprint(mode)] if fitting else []
        if mode in ("full", "lora"):  # lora froze all but the adapters and the head in __init__
            return footprint
        return [FineTuning(mode, self.hparams.finetune_warmup_epochs), *footprint]

    def configure_model(self) -> None:
        # here rather than in __init__: only a run compiles (a module built for inspection or
        # export never pays for it), and the EMA copy above stays an uncompiled plain module
        if self.hparams.compile and getattr(self.net, "_compiled_call_impl", None) is None:
            self.net.compile()

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        self.naflex = getattr(datamodule, "naflex", None)
        if stage == "fit" and self.naflex is not None and (self.mixup is not None or self.distill is not None):
            what = "module.mixup" if self.mixup is not None else "module.distill.teacher"
            raise ConfigError(f"data.naflex.enabled=true feeds patch dicts: {what} needs whole images; "
                              f"set {what}=null or data.naflex.enabled=false")
        if stage == "fit" and self.distill is not None and self.teacher is None:
            d = self.distill
            teacher = load_teacher(d["teacher"], num_classes=self.net.num_classes,
                                   in_chans=getattr(self.net, "in_chans", 3), arch=d["arch"],
                                   kwargs=d["kwargs"], img_size=d["img_size"])  # fmt: skip
            object.__setattr__(self, "teacher", teacher)
        if datamodule is not None and (2 if getattr(datamodule, "multilabel", False) else 1) != self.kind.target_ndim:
            raise ConfigError(f"module.task={self.kind.name} but the data gives "
                              + ("multi-hot label sets: set module.task=multilabel" if self.kind.target_ndim == 1 else
                                 "one class per image: use data=imagefolder data.labels=<labels file>.csv"))
        if stage == "fit" and self.hparams.class_weights == "balanced":
            self.class_weight = self._balanced_weight(self.trainer.datamodule.data_train).to(self.device)

    def _balanced_weight(self, data_train) -> torch.Tensor:
        """Every rank: from the whole training split. Multi-label: pos_weight, negatives / positives per class."""
        return BALANCED_WEIGHTS[self.kind.name](data_train, self.net.num_classes)

    def _loss(self, logits: torch.Tensor, y: torch.Tensor, *, mixed: bool) -> torch.Tensor:
        """The training loss; ``mixed``: ``y`` holds timm Mixup's targets, already smoothed."""
        smoothing = 0.0 if mixed else self.hparams.label_smoothing
        return self.kind.train_loss(logits, y, loss=self.loss_name, settings=self.asl, smoothing=smoothing,
                                    weight=self.class_weight)

    def _train_acc(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        if self.train_acc is not None:
            self.train_acc(logits, y)
            self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, batch_size=len(y))

    def on_fit_start(self) -> None:
        if self.teacher is not None:
            self.teacher.to(self.device)
            if self.distill["precompute"]:
                self._precompute_targets()

    def _precompute_targets(self) -> None:
        """The teacher's logits of every training image and its mirror, once, into the training split
        (``module.distill.precompute``; ``vitpipe.lit.distill``): each step then reads its views' logits."""
        dm = getattr(self.trainer, "datamodule", None)
        data = getattr(dm, "data_train", None)
        if not isinstance(data, TensorImageDataset):
            raise ConfigError("module.distill.precompute=true needs a data set held in memory (digits, fashion_mnist, "
                              f"cifar10, cifar100; not {type(dm).__name__}): set module.distill.precompute=false")
        check_precompute({"augment": dm.augment, "crop_padding": dm.crop_padding, "random_erasing": dm.random_erasing,
                          "auto_augment": dm.auto_augment}, self.mixup)  # preflight checked the config; this, the objects
        transform = {"img_size": list(dm.img_size), "mean": list(dm.mean), "std": list(dm.std),
                     "in_chans": dm.in_chans, "antialias": dm.antialias}
        mirror = bool(dm.augment) and dm.hflip
        shape = (len(data), 2 if mirror else 1, self.net.num_classes)
        key = targets_key(self.teacher, data.images, transform, shape[1])
        folder = Path(dm.root) / "teacher_targets" if getattr(dm, "root", None) else None
        start = time.perf_counter()
        logits = cached_targets(folder, key, lambda: teacher_targets(
            self.teacher, data.images, lambda x: dm.augment_batch(x, train=False), mirror=mirror,
            batch_size=dm.eval_batch_size, device=self.device), shape)  # fmt: skip
        data.set_targets(logits)
        if self.trainer.is_global_zero:  # stdout, as the run's other vitpipe: lines
            print(f"vitpipe: distillation targets of {shape[0]:,} images x {shape[1]} view(s) ready in "
                  f"{time.perf_counter() - start:.0f} s ({folder / (key + '.safetensors') if folder else 'not cached'})",
                  flush=True)

    def on_train_start(self) -> None:
        self.val_acc_best.reset()  # sanity-check steps must not count

    def training_step(self, batch, batch_idx: int):
        x, y, *stored = batch  # stored: the teacher's precomputed logits of these views (module.distill.precompute)
        if isinstance(x, dict):  # NaFlex patch dicts (vitpipe.data.naflex): no mixup/distillation (refused)
            logits = self.net(x)
            loss = self._loss(logits, y, mixed=False)
            if self.naflex is not None:  # timm's --naflex-loss-scale: the batch's share of the token budget
                loss = loss * loss_scale(len(y), self.naflex.batch_size, self.naflex.loss_scale)
            self._train_acc(logits, y)
            return self.finish_training_step(loss, batch_idx)
        mixed = self.mixup is not None and x.shape[0] % 2 == 0  # timm's Mixup needs an even batch
        if mixed:
            x, soft = self.mixup(x, y)
        if self.teacher is not None and hasattr(self.net, "forward_heads"):
            logits, dist_logits = self.net.forward_heads(x)  # DeiT: class head <- labels, dist head <- teacher
        else:
            logits = dist_logits = self.net(x)
        if mixed:
            loss = self._loss(logits, soft, mixed=True)  # soft targets: mean over the batch
        else:
            loss = self._loss(logits, y, mixed=False)
            self._train_acc(logits, y)
        if self.teacher is not None:
            if stored:
                teacher_logits = stored[0]
            else:
                with torch.no_grad():
                    # (B, C), on the same (mixed) images, at the teacher's input size
                    teacher_logits = self.teacher(teacher_input(x, self.teacher.img_size))
            d = self.distill
            loss = combine(loss, dist_logits, teacher_logits, type=d["type"], alpha=d["alpha"], tau=d["tau"])
        return self.finish_training_step(loss, batch_idx)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        # Lightning calls this once per optimizer step (after the last of accumulate_grad_batches
        # micro-batches), so the EMA averages the weights of each update, as timm's train loop does;
        # an update per batch would make the effective decay ema_decay^k under k-batch accumulation.
        if self.ema is None:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # 16-mixed: GradScaler
        scale = scaler.get_scale() if scaler is not None else None
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # a step that left the weights as they were (nonfinite=skip; GradScaler found inf gradients
        # and lowered its scale) is not averaged in: that would count the same weights twice
        if self.step_dropped or (scaler is not None and scaler.get_scale() < scale):
            return
        # this step's number (Lightning counts it once this hook returns): 1 for the first update,
        # where ModelEmaV3 copies the weights, as with timm's num_updates
        self.ema.update(self.net, step=self.global_step + 1)

    def _eval_step(self, batch, loss_metric, metrics, prefix: str) -> torch.Tensor:
        x, y = batch
        logits = self.eval_net(x)
        # unweighted, unsmoothed; per image: the last batch is often smaller
        loss = self.kind.eval_loss(logits, y)
        loss_metric(loss, weight=len(y))
        metrics.update(logits, y)
        self.log(f"{prefix}/loss", loss_metric, on_step=False, on_epoch=True, prog_bar=prefix == "val",
                 batch_size=len(y))
        return logits

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_loss, self.val_metrics, "val")

    def on_validation_epoch_end(self) -> None:
        scores = self.val_metrics.compute()  # synced over ranks: the whole validation set, counted once
        self.val_metrics.reset()
        shown, rest = self.kind.epoch_logs("val", scores)
        self.val_acc_best(scores[self.kind.score])
        self.log_dict(rest, sync_dist=False)
        self.log_dict({**shown, f"val/{self.kind.score}_best": self.val_acc_best.compute()}, prog_bar=True,
                      sync_dist=False)

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        # the logits (B, C) go to callbacks: vitpipe.report collects them for predictions.csv
        return self._eval_step(batch, self.test_loss, self.test_metrics, "test")

    def on_test_epoch_end(self) -> None:
        scores = self.test_metrics.compute()
        self.test_metrics.reset()
        names = getattr(getattr(self.trainer, "datamodule", None), "class_names", None) if self._trainer else None
        shown, rest = self.kind.epoch_logs("test", scores, names)
        self.log_dict({**rest, **shown}, sync_dist=False)


# ---- how each classifier kind weighs its classes (class_weights=balanced): from the training split,
# read through vitpipe.data (a layer above vitpipe.kinds), one entry per kind (vitpipe.kinds.registry.TASKS)


def _balanced_multiclass(data_train, num_classes: int) -> torch.Tensor:
    from vitpipe.data.balance import balanced_class_weights, class_counts, dataset_labels

    return balanced_class_weights(class_counts(dataset_labels(data_train), num_classes))


def _balanced_multilabel(data_train, num_classes: int) -> torch.Tensor:
    from vitpipe.data.multilabel import balanced_pos_weight, multilabel_targets

    return balanced_pos_weight(multilabel_targets(data_train))  # BCE's pos_weight: negatives / positives per class


BALANCED_WEIGHTS = {"multiclass": _balanced_multiclass, "multilabel": _balanced_multilabel}


def _class_weight(value, num_classes: int) -> torch.Tensor | None:
    if value is None or value == "balanced":
        return None
    if isinstance(value, str) or len(value) != num_classes or any(not float(w) >= 0 for w in value):
        raise ValueError(f"module.class_weights={value!r}: use balanced, null or {num_classes} weights >= 0")
    return torch.tensor([float(w) for w in value])

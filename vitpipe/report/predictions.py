"""Per-sample test predictions: collected during ``trainer.test``, gathered over ranks, ``predictions.csv``.

Batches carry no sample index, so the collector asks the test loader's batch sampler for the
indices of each batch: vitpipe's evaluation loaders use an unshuffled, unpadded ``ShardedSampler``
(``order[rank::world]``), so iterating it again gives exactly the indices the loader read, and
after gathering every test image appears once. The labels read back from the data set at those
indices are checked against the batch's, so a sampler that is not deterministic stops the run
instead of writing a wrong file.

The rows depend on the task kind (``pl_module.kind``, vitpipe.kinds): ``Predictions`` (multi-class: top-1
class and confidence) or ``MultilabelPredictions`` (a sigmoid score and the truth per class); both formats
live here, and ``PREDICTION_ROWS`` picks one by the kind's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch import Tensor, nn

from vitpipe.kinds import KINDS, TaskKind
from vitpipe.report.calibration import expected_calibration_error
from vitpipe.report.samples import dataset_targets, sample_path
from vitpipe.run.csvfiles import csv_text, read_csv, read_csv_dicts
from vitpipe.run.files import atomic_write_text

PREDICTIONS_FILE = "predictions.csv"


@dataclass
class Predictions:
    """Predictions on N samples, sorted by ``index``; ``logits`` (N, C) only in memory."""

    index: Tensor  # (N,) int64, position in the evaluated data set
    target: Tensor  # (N,) int64
    pred: Tensor  # (N,) int64, top-1 class
    prob: Tensor  # (N,) float, probability of pred (the top-1 confidence)
    prob_target: Tensor  # (N,) float, probability of target
    paths: list[str] | None = None
    logits: Tensor | None = None  # (N, C)

    @classmethod
    def from_logits(cls, index: Tensor, logits: Tensor, target: Tensor, paths: list[str] | None = None):
        order = index.argsort()
        index, logits, target = index[order], logits[order].float(), target[order]
        probs = KINDS["multiclass"].probabilities(logits)  # (N, C)
        prob, pred = probs.max(-1)
        prob_target = probs.gather(1, target[:, None])[:, 0]
        return cls(index, target, pred, prob, prob_target, paths, logits)

    @property
    def correct(self) -> Tensor:
        return self.pred == self.target

    def accuracy(self) -> float:
        return float(self.correct.double().mean()) if len(self.index) else 0.0

    def ece(self) -> float:
        return expected_calibration_error(self.prob, self.correct)

    def to_csv(self, class_names: list[str] | None = None) -> str:
        names = class_names is not None
        header = (["index"] + (["path"] if self.paths else []) + ["target", "pred", "prob", "prob_target"]
                  + (["target_name", "pred_name"] if names else []))
        rows = []
        for k in range(len(self.index)):
            t, p = int(self.target[k]), int(self.pred[k])
            rows.append([int(self.index[k])] + ([self.paths[k]] if self.paths else [])
                        + [t, p, f"{float(self.prob[k]):.6g}", f"{float(self.prob_target[k]):.6g}"]
                        + ([class_names[t], class_names[p]] if names else []))
        return csv_text(rows, header)  # names and paths as cells a spreadsheet shows, never evaluates

    def write(self, path: Path, class_names: list[str] | None = None) -> Path:
        atomic_write_text(Path(path), self.to_csv(class_names))
        return Path(path)


def read_predictions(path: Path) -> Predictions:
    """predictions.csv -> Predictions (no logits: the file holds what the report needs)."""
    rows = read_csv_dicts(path)

    def col(name, dtype):
        return torch.tensor([dtype(r[name]) for r in rows], dtype=torch.long if dtype is int else torch.float64)

    paths = [r["path"] for r in rows] if rows and "path" in rows[0] else None
    return Predictions(col("index", int), col("target", int), col("pred", int), col("prob", float),
                       col("prob_target", float), paths)


@dataclass
class MultilabelPredictions:
    """Scores on N images sorted by ``index``: ``scores`` (N, C) sigmoid, ``target`` (N, C) 0/1."""

    index: Tensor  # (N,) int64
    target: Tensor  # (N, C) int64 multi-hot
    scores: Tensor  # (N, C) float64 sigmoid of the logits
    paths: list[str] | None = None
    threshold: float = 0.5

    @classmethod
    def from_logits(cls, index: Tensor, logits: Tensor, target: Tensor, paths=None, threshold: float = 0.5):
        order = index.argsort()
        return cls(index[order], target[order].round().long(), KINDS["multilabel"].probabilities(logits[order].double()),
                   [paths[i] for i in order.tolist()] if paths else None, threshold)

    def to_csv(self, class_names: list[str]) -> str:
        header = (["index"] + (["path"] if self.paths else []) + ["labels", "predicted"]
                  + [f"score:{n}" for n in class_names] + [f"true:{n}" for n in class_names])
        pred = self.scores >= self.threshold
        rows = []
        for k in range(len(self.index)):
            true = self.target[k].tolist()
            rows.append([int(self.index[k])] + ([self.paths[k]] if self.paths else [])
                        + [";".join(n for n, t in zip(class_names, true) if t),
                           ";".join(n for n, p in zip(class_names, pred[k].tolist()) if p)]
                        + [repr(s) for s in self.scores[k].tolist()] + [int(t) for t in true])
        return csv_text(rows, header)

    def write(self, path: Path, class_names: list[str]) -> Path:
        atomic_write_text(Path(path), self.to_csv(class_names))
        return Path(path)


def read_multilabel_predictions(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """predictions.csv -> (class names, scores (N, C) float64, targets (N, C) int)."""
    header, *rows = read_csv(path)
    score_cols = [i for i, h in enumerate(header) if h.startswith("score:")]
    true_cols = [i for i, h in enumerate(header) if h.startswith("true:")]
    names = [header[i].removeprefix("score:") for i in score_cols]
    scores = np.array([[float(r[i]) for i in score_cols] for r in rows], dtype=np.float64).reshape(len(rows), -1)
    target = np.array([[int(r[i]) for i in true_cols] for r in rows], dtype=np.int64).reshape(len(rows), -1)
    return names, scores, target



class TestPredictions(L.Callback):
    """Collect (index, logits, target) of every test batch; after the epoch ``self.result`` holds the
    Predictions of the whole test set on every rank, and ``test/ece`` is logged (15 bins, L1).

    The module's task kind (``pl_module.kind``) picks the rows (``PREDICTION_ROWS``): multi-label classifiers
    (targets (B, C)) give ``MultilabelPredictions`` (sigmoid scores; no ECE).
    Needs a classifier batch ``(x, y)``. The logits are what ``test_step`` returns when it returns
    a (B, C) tensor; otherwise the callback runs the module's evaluation network on ``x`` again.
    Other modules (captioners) are left alone.
    """

    def __init__(self) -> None:
        self.result: Predictions | None = None
        self._parts: list[tuple[Tensor, Tensor, Tensor]] = []
        self._batches: list[list[int]] | None = None

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.result, self._parts = None, []
        loader = trainer.test_dataloaders
        loader = loader[0] if isinstance(loader, (list, tuple)) else loader
        batch_sampler = getattr(loader, "batch_sampler", None)
        self._batches = [list(b) for b in batch_sampler] if batch_sampler is not None else None

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if dataloader_idx != 0 or not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            return
        x, y = batch
        kind = _kind(pl_module)
        if kind is None or y.ndim != kind.target_ndim:
            return
        if self._batches is None:
            raise RuntimeError("the test loader has no batch sampler: cannot tell which images a batch holds")
        index = torch.tensor(self._batches[batch_idx], dtype=torch.long)
        if len(index) != len(y):
            raise RuntimeError(f"test batch {batch_idx} holds {len(y)} images, its sampler gave {len(index)} indices")
        logits = (outputs if isinstance(outputs, Tensor) and outputs.ndim == 2 and len(outputs) == len(y)
                  else _eval_logits(pl_module, x))
        self._parts.append((index.to(y.device), logits.detach().float(), y.detach()))

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._parts:
            return
        index, logits, target = (torch.cat(t) for t in zip(*self._parts))
        self._parts = []
        index, logits, target = gather_unequal(trainer, index, logits, target)
        index, logits, target = index.cpu(), logits.cpu(), target.cpu()
        if len(index.unique()) != len(index):
            raise RuntimeError("a test image was evaluated twice (a padded sampler?); predictions would double count")
        ds = _test_dataset(trainer)
        if ds is not None:
            known = KNOWN_TARGETS[_kind(pl_module).name](ds, index)
            if known is not None and not torch.equal(known, target):
                raise RuntimeError("test labels differ from the data set's at the sampler's indices: "
                                   "the test loader's order is not deterministic")
        paths = None
        if ds is not None and len(index) and sample_path(ds, int(index[0])) is not None:
            paths = [sample_path(ds, int(i)) for i in index]
        self.result = PREDICTION_ROWS[_kind(pl_module).name](pl_module, index, logits, target, paths)


def gather_unequal(trainer: L.Trainer, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Concatenate each rank's tensors (same count along dim 0 within a rank, counts may differ
    across ranks: unpadded evaluation shards) into the whole, on every rank, rank order."""
    if trainer.world_size == 1:
        return tensors
    strategy = trainer.strategy
    n = torch.tensor([len(tensors[0])], device=tensors[0].device)
    counts = strategy.all_gather(n).view(-1).tolist()  # (world,)
    longest = max(counts)
    out = []
    for t in tensors:
        pad = torch.zeros((longest - len(t), *t.shape[1:]), dtype=t.dtype, device=t.device)
        g = strategy.all_gather(torch.cat([t, pad]))  # (world, longest, ...)
        out.append(torch.cat([g[r, :c] for r, c in enumerate(counts)]))
    return tuple(out)


def _kind(pl_module: L.LightningModule) -> TaskKind | None:
    """The module's task kind when it classifies (a captioner or an MAE module has no prediction rows)."""
    kind = getattr(pl_module, "kind", None)
    return kind if isinstance(kind, TaskKind) and kind.classifies else None


def _multiclass_rows(pl_module, index: Tensor, logits: Tensor, target: Tensor, paths) -> Predictions:
    result = Predictions.from_logits(index, logits, target, paths)
    # the same on every rank (all hold the gathered set): no further sync
    pl_module.log("test/ece", result.ece(), sync_dist=False)
    return result


def _multilabel_rows(pl_module, index: Tensor, logits: Tensor, target: Tensor, paths) -> MultilabelPredictions:
    # sigmoid scores per class; no top-1 confidence, so no ECE
    return MultilabelPredictions.from_logits(index, logits, target, paths, threshold=float(pl_module.hparams.threshold))


def _multilabel_known(ds, index: Tensor) -> Tensor | None:
    """The data set's (N, C) multi-hot rows at ``index``, read without images."""
    from vitpipe.data.multilabel import multilabel_targets

    try:
        return multilabel_targets(ds)[index].to(torch.float32)
    except Exception:  # noqa: BLE001 - a wrapper it cannot see through: nothing to check against
        return None


# per classifier kind (vitpipe.kinds.registry.TASKS): the rows of predictions.csv and the labels they are checked against
PREDICTION_ROWS = {"multiclass": _multiclass_rows, "multilabel": _multilabel_rows}
KNOWN_TARGETS = {"multiclass": dataset_targets, "multilabel": _multilabel_known}


def evaluated_net(module: L.LightningModule) -> nn.Module:
    """The network ``test_step`` runs: ImageClassifier's ``eval_net`` (the EMA copy when kept)."""
    net = getattr(module, "eval_net", None)
    if isinstance(net, nn.Module):
        return net
    ema = getattr(module, "ema", None)
    return ema.module if ema is not None else module.net


def _eval_logits(pl_module: L.LightningModule, x: Tensor) -> Tensor:
    with torch.no_grad():
        return evaluated_net(pl_module)(x)


def _test_dataset(trainer: L.Trainer):
    return getattr(trainer.datamodule, "data_test", None) if trainer.datamodule is not None else None

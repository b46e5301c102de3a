"""CaptionModule: the LightningModule for image captioning.

Teacher-forced cross-entropy for training; validation and test decode (greedy or beam) and score
the corpus with BLEU-1..4 and CIDEr-D (coco-caption's definitions). The tokenizer travels inside
the checkpoint, so a checkpoint decodes on its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torchmetrics import MaxMetric, MeanMetric

from vitpipe.errors import ConfigError
from vitpipe.kinds import KINDS
from vitpipe.lit.nonfinite import NonFiniteGuard, check_policy
from vitpipe.lit.optim import ConfiguredOptimizers
from vitpipe.lit.reload import LoadsStoredRun
from vitpipe.metrics import CaptionScores
from vitpipe.models.captioner import Captioner
from vitpipe.text.tokenizer import WordTokenizer

log = logging.getLogger(__name__)

SCORE_KEYS = ("bleu1", "bleu2", "bleu3", "bleu4", "cider")


class CaptionModule(LoadsStoredRun, NonFiniteGuard, ConfiguredOptimizers, L.LightningModule):
    """Args:
        net: a ``Captioner``.
        tokenizer: the data's ``WordTokenizer`` (``dm.module_kwargs()``); replaced by the one saved
            in a checkpoint when one is loaded.
        optimizer: a partial optimizer (``_partial_: true``), called on parameter groups.
        scheduler: a partial timm scheduler, called with ``t_initial`` and ``warmup_t`` in steps.
        warmup_fraction: fraction of all optimizer steps spent warming up.
        label_smoothing: on the training loss (Szegedy et al. 2016); validation loss is plain CE.
        beam_size, length_penalty, max_gen_len: decoding for validation, test and predict
            (``Captioner.generate``; ``max_gen_len=None``: the decoder's max_len).
        num_samples: captions logged as text after each validation (and as a wandb Table).
        nonfinite: what a NaN/inf loss does, as in the classifier (``vitpipe.lit.nonfinite``):
            ``"error"`` stops naming the step, ``"skip"`` drops the step on every rank.
    """

    kind = KINDS["captioning"]  # what predict, eval, report and export ask instead of probing the network

    def __init__(self, net: Captioner, tokenizer: WordTokenizer, optimizer, scheduler=None, *,
                 warmup_fraction: float = 0.05, label_smoothing: float = 0.0, beam_size: int = 1,
                 length_penalty: float = 1.0, max_gen_len: int | None = None, num_samples: int = 8,
                 nonfinite: str = "error") -> None:
        super().__init__()
        check_policy(nonfinite)
        self.save_hyperparameters(ignore=["net", "tokenizer", "optimizer", "scheduler"], logger=False)
        if tokenizer.vocab_size != net.vocab_size or tokenizer.pad_id != net.pad_id:
            raise ConfigError(f"tokenizer (vocab_size={tokenizer.vocab_size}) and model (vocab_size={net.vocab_size}) "
                             "disagree; build the model from the data module's model_kwargs()")
        self.net, self.tokenizer = net, tokenizer
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_scores, self.test_scores = CaptionScores(), CaptionScores()
        self.val_cider_best = MaxMetric()
        self.predictions: list[dict] = []  # of the last validation/test epoch, this process

    # ------------------------------------------------------------------ training

    def _loss(self, batch, label_smoothing: float = 0.0) -> torch.Tensor:
        tokens = batch["tokens"]  # (B, T): <bos> words <eos> <pad>...
        # right padding under a causal mask never reaches a real position, so no padding mask is
        # needed here (tested); pad targets are ignored by the loss
        logits = self.net(batch["images"], tokens[:, :-1])  # (B, T-1, vocab)
        return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], ignore_index=self.tokenizer.pad_id,
                               label_smoothing=label_smoothing)

    def on_train_start(self) -> None:
        self.val_cider_best.reset()  # sanity-check steps must not count

    def training_step(self, batch, batch_idx: int):
        loss = self._loss(batch, self.hparams.label_smoothing)
        return self.finish_training_step(loss, batch_idx)

    # ------------------------------------------------------------------ decoding and scoring

    def caption(self, images: torch.Tensor) -> list[str]:
        ids = self.net.generate(images, max_len=self.hparams.max_gen_len, beam_size=self.hparams.beam_size,
                                length_penalty=self.hparams.length_penalty)
        return self.tokenizer.batch_decode(ids)

    def _eval_step(self, batch, loss_metric: MeanMetric, scores: CaptionScores, prefix: str) -> None:
        loss_metric(self._loss(batch))
        self.log(f"{prefix}/loss", loss_metric, on_step=False, on_epoch=True, prog_bar=prefix == "val")
        preds = self.caption(batch["images"])
        scores.update(preds, batch["refs"])
        self.predictions += [{"image_id": int(i), "caption": p, "refs": r}
                             for i, p, r in zip(batch["image_ids"].tolist(), preds, batch["refs"])]

    def _scores_end(self, scores: CaptionScores, prefix: str) -> dict[str, torch.Tensor] | None:
        if not scores.update_called:
            return None
        values = scores.compute()  # synced over ranks: the whole corpus, scored once on each
        scores.reset()
        self.predictions = _gather(self.predictions)  # the same rows the scores saw, every rank's
        # how many captions were scored: the eval shards are not padded, so each image once
        self.log(f"{prefix}/num_images", float(len(self.predictions)), sync_dist=False)
        self.log_dict({f"{prefix}/{k}": values[k].float() for k in SCORE_KEYS}, prog_bar=prefix == "val",
                      sync_dist=False)
        return values

    def on_validation_epoch_start(self) -> None:
        self.predictions = []

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_loss, self.val_scores, "val")

    def on_validation_epoch_end(self) -> None:
        values = self._scores_end(self.val_scores, "val")
        if values is None:
            return
        self.val_cider_best(values["cider"].float())
        self.log("val/cider_best", self.val_cider_best.compute(), prog_bar=True)
        self._log_samples("val")

    def on_test_epoch_start(self) -> None:
        self.predictions = []

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_loss, self.test_scores, "test")

    def on_test_epoch_end(self) -> None:
        if self._scores_end(self.test_scores, "test") is not None:
            self._log_samples("test")

    def write_predictions(self, path: str | Path) -> Path | None:
        """Write the last validation/test epoch's captions as COCO results JSON
        (``[{"image_id", "caption"}, ...]``, sorted by image id, every rank's included). Only
        global rank zero writes (the rows were gathered to every rank); others return None."""
        if self._trainer is not None and not self.trainer.is_global_zero:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        captions = {p["image_id"]: p["caption"] for p in self.predictions}
        rows = [{"image_id": i, "caption": captions[i]} for i in sorted(captions)]
        path.write_text(json.dumps(rows, indent=1) + "\n")
        return path

    def _log_samples(self, prefix: str) -> None:
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        rows = [[p["image_id"], p["caption"], p["refs"][0]] for p in self.predictions[: self.hparams.num_samples]]
        log.info("%s samples (epoch %d):\n%s", prefix, self.current_epoch,
                 "\n".join(f"  {i}: {c!r}  (ref: {r!r})" for i, c, r in rows))
        for lg in self.loggers:
            if isinstance(lg, WandbLogger):
                lg.log_table(key=f"{prefix}/samples", columns=["image_id", "caption", "reference"], data=rows)
            elif isinstance(lg, TensorBoardLogger):
                text = "\n\n".join(f"**{i}**: {c}  \n_ref_: {r}" for i, c, r in rows)
                lg.experiment.add_text(f"{prefix}/samples", text, global_step=self.global_step)

    # ------------------------------------------------------------------ checkpoint and optimisation

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokenizer"] = self.tokenizer.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "tokenizer" in checkpoint:
            self.tokenizer = WordTokenizer.from_state_dict(checkpoint["tokenizer"])


def _gather(rows: list[dict]) -> list[dict]:
    """Every rank's rows on every rank (a DistributedSampler shards val/test across processes)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return [r for part in parts for r in part]

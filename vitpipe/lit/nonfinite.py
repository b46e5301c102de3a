"""What a NaN/inf training loss does, the same for every LightningModule and every rank count.

``nonfinite="error"`` stops the run with ``NonFiniteLossError`` naming the step; ``"skip"`` drops
the optimizer step the batch belongs to and counts the batch (``train/skipped_batches``, printed at
the end of training).

Under DDP the ranks first agree: one all-reduce of a 0/1 flag per batch, so a NaN on one rank makes
every rank stop, or skip, at the same step. A rank acting alone would leave the others waiting
forever in the gradient all-reduce. Skipping keeps the DDP step intact (Lightning refuses a
``training_step`` that returns ``None`` under DDP): every rank still runs backward, and then every
rank clears the gradients before the optimizer step. A cleared gradient (``None``) leaves AdamW's
weights, moments and step count alone; a zero gradient would not (momentum and decoupled weight
decay still move the weights).
"""

from __future__ import annotations

import torch

NONFINITE_POLICIES = ("error", "skip")


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or inf."""


def check_policy(nonfinite: str) -> None:
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"module.nonfinite={nonfinite!r}; valid choices: {', '.join(NONFINITE_POLICIES)}")


class NonFiniteGuard:
    """LightningModule mixin; needs ``hparams.nonfinite`` (and ``train_loss``, a ``MeanMetric``, for
    ``finish_training_step``).

    A ``training_step`` ends with ``return self.finish_training_step(loss, batch_idx)``; it logs
    ``train/loss`` when the loss is finite. Otherwise ``loss_is_finite`` raises (error mode) or says
    False (skip mode): the step's gradients are then dropped in ``on_before_optimizer_step``; with
    gradient accumulation, the whole accumulated step. ``step_dropped`` then says so until the next
    optimizer step (the EMA skips such a step).
    """

    skipped_batches: int = 0
    _drop_step: bool = False
    step_dropped: bool = False  # whether the latest optimizer step was dropped (its weights left as they were)

    def loss_is_finite(self, loss: torch.Tensor, batch_idx: int) -> bool:
        bad = (~torch.isfinite(loss.detach())).float()
        local = bool(bad)
        if self.trainer.world_size > 1:
            bad = self.trainer.strategy.reduce(bad, reduce_op="sum")  # every rank sees every rank's flag
        if not bad:
            return True
        if self.hparams.nonfinite == "skip":
            self.skipped_batches += 1
            self._drop_step = True
            self.log("train/skipped_batches", float(self.skipped_batches), on_step=True, on_epoch=False)
            return False
        where = f"at global step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx})"
        value = loss.item() if local else f"non-finite on another rank (this is rank {self.global_rank})"
        raise NonFiniteLossError(f"loss is {value} {where}; lower module.optimizer.lr, or set "
                                 f"module.nonfinite=skip to drop such batches")

    def finish_training_step(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """The end of every ``training_step``: the non-finite check, then ``train/loss``; returns ``loss``."""
        if not self.loss_is_finite(loss, batch_idx):
            return loss  # nonfinite=skip: every rank drops this step's gradients before the update
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.step_dropped = self._drop_step
        if self._drop_step:  # the same decision on every rank (the flag was all-reduced)
            for p in self.parameters():
                p.grad = None
            self._drop_step = False

    def on_train_end(self) -> None:
        if self.hparams.nonfinite == "skip" and self.trainer.is_global_zero:
            print(f"vitpipe: skipped {self.skipped_batches} batch(es) with a non-finite loss (module.nonfinite=skip)")

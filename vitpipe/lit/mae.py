"""MAEModule: the LightningModule for masked-autoencoder pre-training (He et al. 2022).

It receives a built ``net`` (``vitpipe.models.mae.MaskedAutoencoderViT``, ``net(imgs, mask_ratio,
noise) -> (loss, pred, mask)``) and partial optimizer/scheduler from the config, as ImageClassifier
does; the network owns masking, decoder and loss, and its weight-decay exclusions
(``no_weight_decay()``: tokens and positions; norms and biases are never decayed, vitpipe.lit.optim).
Labels in batches are ignored: any classification data set (or an unlabeled image folder,
``data.labels=none``) pre-trains.

Training masks with fresh noise each step (the network draws it from torch's generator, which a
resumed run restores). Validation and test mask each batch with noise seeded by ``eval_seed`` and
the batch index: the same patches of the same image are hidden in every epoch, so ``val/loss`` is
comparable across epochs and the best checkpoint is chosen on one fixed task.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric, MinMetric

from vitpipe.kinds import KINDS
from vitpipe.lit.nonfinite import NonFiniteGuard, check_policy
from vitpipe.lit.optim import ConfiguredOptimizers
from vitpipe.lit.reload import LoadsStoredRun

__all__ = ["MAEModule"]


class MAEModule(LoadsStoredRun, NonFiniteGuard, ConfiguredOptimizers, L.LightningModule):
    """Masked-patch reconstruction loss per split: ``train/loss``, ``val/loss``, ``val/loss_best``, ``test/loss``.

    Args:
        net: a masked autoencoder, ``net(imgs, mask_ratio=..., noise=None) -> (loss, pred, mask)``
            with ``patchify(imgs) -> (B, L, patch_dim)``.
        optimizer: a partial optimizer (``_partial_: true``), called on parameter groups.
        scheduler: a partial timm scheduler, called with ``t_initial`` and ``warmup_t`` in steps.
        mask_ratio: fraction of the patches hidden from the encoder (the paper's 0.75).
        warmup_fraction: fraction of all optimizer steps spent warming up.
        eval_seed: seeds the validation/test masks (one generator per batch: ``eval_seed + batch_idx``).
        compile: ``torch.compile`` the network in place when a Trainer starts.
        nonfinite: what a NaN/inf loss does (``vitpipe.lit.nonfinite``): ``error`` | ``skip``.
    """

    kind = KINDS["mae"]  # what predict, eval, report and export ask instead of probing the network

    def __init__(self, net: nn.Module, optimizer, scheduler=None, *, mask_ratio: float = 0.75,
                 warmup_fraction: float = 0.05, eval_seed: int = 0, compile: bool = False,
                 nonfinite: str = "error") -> None:
        super().__init__()
        check_policy(nonfinite)
        if isinstance(mask_ratio, bool) or not isinstance(mask_ratio, (int, float)) or not 0 <= mask_ratio < 1:
            raise ValueError(f"module.mask_ratio={mask_ratio!r}: expected a fraction in [0, 1) (the paper's 0.75)")
        grid = getattr(net, "grid_size", None)
        if grid is not None:  # the loss is a mean over the masked patches: it needs one, and the encoder one kept
            patches = int(grid[0]) * int(grid[1])
            keep = int(patches * (1 - mask_ratio))
            if not 1 <= keep < patches:
                raise ValueError(
                    f"module.mask_ratio={mask_ratio!r} keeps {keep} of the {patches} patches: training needs at "
                    f"least one masked (the loss is over masked patches only) and one kept; valid: a ratio above 0 "
                    f"that keeps int({patches} x (1 - ratio)) >= 1 patches, e.g. the paper's 0.75")
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"], logger=False)
        self.net = net
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.skipped_batches = 0
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_loss_best = MinMetric()

    def forward(self, imgs: torch.Tensor, mask_ratio: float | None = None, noise: torch.Tensor | None = None):
        ratio = self.hparams.mask_ratio if mask_ratio is None else mask_ratio
        return self.net(imgs, mask_ratio=ratio, noise=noise)

    def configure_model(self) -> None:
        if self.hparams.compile and getattr(self.net, "_compiled_call_impl", None) is None:
            self.net.compile()

    def on_train_start(self) -> None:
        self.val_loss_best.reset()  # sanity-check steps must not count

    def training_step(self, batch, batch_idx: int):
        loss, _, _ = self(_images(batch))
        return self.finish_training_step(loss, batch_idx)

    def eval_noise(self, imgs: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """(B, L) uniform noise for the masks of evaluation batch ``batch_idx``: the same every epoch."""
        gen = torch.Generator().manual_seed(int(self.hparams.eval_seed) + batch_idx)
        num_patches = self.net.patchify(imgs[:1]).shape[1]  # (1, L, patch_dim)
        return torch.rand(imgs.shape[0], num_patches, generator=gen).to(imgs.device)

    def _eval_step(self, batch, batch_idx: int, loss_metric: MeanMetric, prefix: str) -> torch.Tensor:
        imgs = _images(batch)
        loss, _, _ = self(imgs, noise=self.eval_noise(imgs, batch_idx))
        # the loss is a mean over each image's masked patches (the same count per image): weighted by
        # images, the epoch value is the per-image mean even with a smaller last batch
        loss_metric(loss, weight=imgs.shape[0])
        self.log(f"{prefix}/loss", loss_metric, on_step=False, on_epoch=True, prog_bar=prefix == "val")
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.val_loss, "val")

    def on_validation_epoch_end(self) -> None:
        self.val_loss_best(self.val_loss.compute())  # synced over ranks
        self.log("val/loss_best", self.val_loss_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, batch_idx, self.test_loss, "test")


def _images(batch) -> torch.Tensor:
    """The images of a batch ``(x, y)`` (labels ignored) or ``{"images": x, ...}``."""
    return batch["images"] if isinstance(batch, dict) else batch[0]

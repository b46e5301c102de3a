"""Progressive resolution: train at smaller images (and larger batches) first, the model's size last
(timm's ``--train-img-sizes`` / ``--train-batch-sizes`` / ``--train-size-schedule``; FixRes, Touvron
et al. 2019, on why the last stage should be at the test size).

``ProgressiveResolution(img_sizes=[16, 24, 32], batch_sizes=[256, 128, 64], start_epochs=[0, 4, 8])``:
stage i runs from epoch ``start_epochs[i]`` on. The data module reads ``img_size`` and ``batch_size`` when
it builds a batch / a loader, so the callback sets them for the epoch whose loader Lightning asks for
(the sampler's epoch, restored on resume: a resumed run continues in the stage it stopped in, its
mid-epoch skip counted in that stage's batches) and has the train loader rebuilt every epoch.
Validation runs at the current stage's size; after fit, ``img_size`` and ``batch_size`` go back to the
data config's, so ``trainer.test`` sees the model's size. The ViT runs at any size its patch divides
(positions resampled). The fast path only: the standard path's transforms fix the size at setup.
"""

from __future__ import annotations

import lightning as L

from vitpipe.nn.patch_embed import to_2tuple


def _positive_ints(values, key: str, *, allow_null: bool = False) -> list | None:
    if values is None and allow_null:
        return None
    if isinstance(values, (int, str)) or not values or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise ValueError(f"callbacks.progressive.{key}={values!r}; use a non-empty list of positive integers"
                         + (" or null" if allow_null else ""))
    return list(values)


class ProgressiveResolution(L.Callback):
    def __init__(self, img_sizes: list[int], start_epochs: list[int], batch_sizes: list[int] | None = None) -> None:
        self.img_sizes = _positive_ints(img_sizes, "img_sizes")
        self.batch_sizes = _positive_ints(batch_sizes, "batch_sizes", allow_null=True)
        if isinstance(start_epochs, (int, str)) or not start_epochs or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in start_epochs):
            raise ValueError(f"callbacks.progressive.start_epochs={start_epochs!r}; use a list of epochs, 0 first")
        self.start_epochs = list(start_epochs)
        n = len(self.img_sizes)
        if len(self.start_epochs) != n or (self.batch_sizes is not None and len(self.batch_sizes) != n):
            raise ValueError(f"callbacks.progressive: img_sizes ({n}), start_epochs ({len(self.start_epochs)})"
                             + (f" and batch_sizes ({len(self.batch_sizes)})" if self.batch_sizes else "")
                             + " need one entry per stage")
        if self.start_epochs[0] != 0 or any(b <= a for a, b in zip(self.start_epochs, self.start_epochs[1:])):
            raise ValueError(f"callbacks.progressive.start_epochs={self.start_epochs}; use increasing epochs "
                             "starting at 0, e.g. [0, 4, 8]")
        self._original = None  # (img_size, batch_size) of the data config, put back after fit

    def stage(self, epoch: int) -> int:
        """Index of the stage epoch ``epoch`` trains in."""
        return max(i for i, start in enumerate(self.start_epochs) if start <= epoch)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "img_size") or not hasattr(dm, "batch_size"):
            raise ValueError("callbacks.progressive needs a vitpipe data module (img_size, batch_size)")
        if not getattr(dm, "fast_path", False) or getattr(dm, "naflex", None) is not None:
            raise ValueError("callbacks.progressive needs data.fast_path=true without NaFlex: the standard path's "
                             "transforms fix img_size at setup")
        patch = getattr(getattr(pl_module, "net", None), "patch_size", None)
        sizes = [patch] if patch is not None else []
        sizes += list(getattr(pl_module.net, "flexi_patch_sizes", None) or [])
        for s in self.img_sizes:
            for p in sizes:
                (P, Q) = to_2tuple(p)
                if s % P or s % Q:
                    raise ValueError(f"callbacks.progressive.img_sizes: {s} is not divisible by the model's patch "
                                     f"size {P}; use multiples of {P}")
        self._original = (dm.img_size, dm.batch_size)
        build = type(dm).train_dataloader

        def train_dataloader():  # Lightning asks for the next epoch's loader: set that epoch's stage first
            self.apply(dm, trainer.fit_loop.epoch_progress.current.processed)
            return build(dm)

        dm.train_dataloader = train_dataloader
        trainer.reload_dataloaders_every_n_epochs = 1  # a batch size takes effect in a new loader

    def apply(self, dm, epoch: int) -> None:
        i = self.stage(epoch)
        dm.img_size = to_2tuple(self.img_sizes[i])
        if self.batch_sizes is not None:
            dm.batch_size = self.batch_sizes[i]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        size, batch = trainer.datamodule.img_size, trainer.datamodule.batch_size
        pl_module.log_dict({"train/img_size": float(size[0]), "train/batch_size": float(batch)}, on_step=False,
                           on_epoch=True, batch_size=1)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and self._original is not None:
            dm = trainer.datamodule
            dm.img_size, dm.batch_size = self._original
            vars(dm).pop("train_dataloader", None)
            self._original = None

"""Progressive resolution: train at smaller images (and larger batches) first, the model's size last
(timm's ``--train-img-sizes`` / ``--train-batch-sizes`` / ``--train-size-schedule``; FixRes, Touvron
et al. 2019, on why the last stage should be at the test size).

``ProgressiveResolution(img_sizes=[16, 24, 32], batch_sizes=[256, 128, 64], start_epochs=[0, 4, 8])``:
stage i runs from epoch ``start_epochs[i]`` on. The data module reads ``img_size`` and ``batch_size`` when
it builds a batch / a loader, so the callback sets them for the epoch whose loader Lightning asks for
(the sampler's epoch, restored on resume: a resumed run continues in the stage it stopped in, its
mid-epoch skip counted in that stage's batches) and has the train loader rebuilt every epoch.
``img_sizes=None`` and/or ``start_epochs=None`` derive the schedule at setup: three stages (or as many as
``start_epochs`` lists) at 1/2 ... 1 of the data's ``img_size``, each rounded down to a multiple of the
patch (duplicates dropped), starting at even fractions of ``trainer.max_epochs``.
Validation runs at the current stage's size; after fit, ``img_size`` and ``batch_size`` go back to the
data config's, so ``trainer.test`` sees the model's size. The ViT runs at any size its patch divides
(positions resampled). The fast path only: the standard path's transforms fix the size at setup.
"""

from __future__ import annotations

import math

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


DEFAULT_STAGES = 3


def default_img_sizes(img_size: int, multiple: int, stages: int) -> list[int]:
    """``stages`` sizes evenly from ``img_size / 2`` to ``img_size``, rounded down to ``multiple``, no repeats."""
    sizes = []
    for i in range(stages):
        fraction = 0.5 + 0.5 * i / (stages - 1) if stages > 1 else 1.0
        s = max(multiple, int(img_size * fraction) // multiple * multiple)
        if s not in sizes:
            sizes.append(s)
    return sizes


def default_start_epochs(stages: int, max_epochs: int | None) -> list[int]:
    """Stage i starts at ``round(i * max_epochs / stages)``."""
    if max_epochs is None or max_epochs < stages:
        raise ValueError(f"callbacks.progressive.start_epochs=null needs trainer.max_epochs >= {stages} (one epoch "
                         f"per stage), got {max_epochs}; set trainer.max_epochs or callbacks.progressive.start_epochs")
    return [round(i * max_epochs / stages) for i in range(stages)]


class ProgressiveResolution(L.Callback):
    def __init__(self, img_sizes: list[int] | None = None, start_epochs: list[int] | None = None,
                 batch_sizes: list[int] | None = None) -> None:
        self.img_sizes = _positive_ints(img_sizes, "img_sizes", allow_null=True)
        self.batch_sizes = _positive_ints(batch_sizes, "batch_sizes", allow_null=True)
        if start_epochs is not None and (isinstance(start_epochs, (int, str)) or not start_epochs or not all(
                isinstance(e, int) and not isinstance(e, bool) for e in start_epochs)):
            raise ValueError(f"callbacks.progressive.start_epochs={start_epochs!r}; use a list of epochs, 0 first "
                             "or null")
        self.start_epochs = None if start_epochs is None else list(start_epochs)
        if self.img_sizes is not None and self.start_epochs is not None:
            self._check()
        self._original = None  # (img_size, batch_size) of the data config, put back after fit

    def _check(self) -> None:
        n = len(self.img_sizes)
        if len(self.start_epochs) != n or (self.batch_sizes is not None and len(self.batch_sizes) != n):
            raise ValueError(f"callbacks.progressive: img_sizes ({n}), start_epochs ({len(self.start_epochs)})"
                             + (f" and batch_sizes ({len(self.batch_sizes)})" if self.batch_sizes else "")
                             + " need one entry per stage")
        if self.start_epochs[0] != 0 or any(b <= a for a, b in zip(self.start_epochs, self.start_epochs[1:])):
            raise ValueError(f"callbacks.progressive.start_epochs={self.start_epochs}; use increasing epochs "
                             "starting at 0, e.g. [0, 4, 8]")

    def _derive(self, img_size: int, multiple: int, max_epochs: int | None) -> None:
        """Fill in a null ``img_sizes`` / ``start_epochs`` from the data, the model and the trainer."""
        if self.img_sizes is None:
            listed = self.start_epochs if self.start_epochs is not None else self.batch_sizes
            stages = len(listed) if listed is not None else DEFAULT_STAGES
            self.img_sizes = default_img_sizes(img_size, multiple, stages)
            if listed is not None and len(self.img_sizes) != stages:
                raise ValueError(f"callbacks.progressive.img_sizes=null: {img_size} px with patch {multiple} has "
                                 f"{len(self.img_sizes)} distinct sizes from half to full ({self.img_sizes}), not "
                                 f"{stages} stages; list callbacks.progressive.img_sizes")
        if self.start_epochs is None:
            self.start_epochs = default_start_epochs(len(self.img_sizes), max_epochs)
        self._check()

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
        if self.img_sizes is None or self.start_epochs is None:
            multiple = math.lcm(*(to_2tuple(p)[0] for p in sizes)) if sizes else 1
            self._derive(to_2tuple(dm.img_size)[0], multiple, trainer.max_epochs)
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

"""RolloutCallback: attention rollout of a fixed set of validation images, logged during training.

The attention comes from ``forward_features(x, return_attn=True)`` on the callback's own forward
pass, in eval mode: training steps keep the fused SDPA kernel (no hooks, no global switch; hooks on
an attention module record nothing once SDPA is on).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch import Tensor

from vitpipe.config.options import check_rollout_settings
from vitpipe.errors import ConfigError
from vitpipe.nn.modes import eval_mode
from vitpipe.viz.overlay import overlay_grid, save_figure, unnormalize
from vitpipe.viz.rollout import rollout_for_model


class RolloutCallback(L.Callback):
    """Every ``every_n_epochs`` validation epochs, overlay the attention rollout of ``num_images``
    validation images and log it: wandb image (WandbLogger), TensorBoard image (TensorBoardLogger),
    and always ``<dirpath>/epoch_XXX.png``; on rank 0 only.

    The images are the first ``num_images`` of the first validation run (the validation loader does
    not shuffle, and they are kept from then on), taken after the data module's eval transform, so
    every epoch shows the same images as the model sees them.

    Args:
        every_n_epochs: log on epochs 0, n, 2n, ... (counted from 0).
        num_images: validation images to follow.
        head_fusion, discard_ratio: see ``attention_rollout``.
        dirpath: PNG folder; None = ``<trainer.default_root_dir>/rollout`` (the run directory).
        mean, std: to display the normalised images; None = the data module's ``mean``/``std``
            (ImageNet statistics if it has none).
        ncols, alpha, cmap: figure layout and heatmap style.
    """

    def __init__(self, *, every_n_epochs: int = 1, num_images: int = 8, head_fusion: str = "mean",
                 discard_ratio: float = 0.0, dirpath: str | None = None, mean=None, std=None, ncols: int = 4,
                 alpha: float = 0.5, cmap: str = "jet") -> None:
        if not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ConfigError(f"callbacks.rollout.every_n_epochs={every_n_epochs!r}: use an int >= 1")
        if not isinstance(num_images, int) or num_images < 1:
            raise ConfigError(f"callbacks.rollout.num_images={num_images!r}: use an int >= 1")
        check_rollout_settings(head_fusion=head_fusion, discard_ratio=discard_ratio)  # now, not after epoch 0
        self.every_n_epochs, self.num_images = every_n_epochs, num_images
        self.head_fusion, self.discard_ratio = head_fusion, discard_ratio
        self.dirpath = dirpath
        self.mean, self.std = mean, std
        self.ncols, self.alpha, self.cmap = ncols, alpha, cmap
        self.images: Tensor | None = None  # (num_images, C, H, W) model inputs, on the CPU, fixed once taken
        self.labels: list[int] | None = None

    # ---------------------------------------------------------------- collecting the images

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.images, self.labels = None, None
        self.off = _vit(pl_module) is None  # e.g. MAE pre-training: its network is no ViT to explain
        if self.off and trainer.is_global_zero:
            print(f"vitpipe: note: callbacks.rollout: {type(pl_module.net).__name__} has no ViT encoder "
                  "(forward_features) to explain; no rollout in this run", flush=True)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if self.off or self.images is not None and len(self.images) >= self.num_images or dataloader_idx != 0:
            return
        x, y = (batch["images"], None) if isinstance(batch, dict) else (batch[0], batch[1])
        x = x.detach().float().cpu()
        y = None if y is None else y.detach().cpu().tolist()
        need = self.num_images - (0 if self.images is None else len(self.images))
        self.images = x[:need] if self.images is None else torch.cat([self.images, x[:need]])
        if y is not None:
            self.labels = (self.labels or []) + y[:need]

    # ---------------------------------------------------------------- rollout and logging

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.images is None or trainer.current_epoch % self.every_n_epochs:
            return
        if not trainer.is_global_zero:
            return
        maps, titles = self.compute(pl_module)
        fig = overlay_grid(self._display(trainer), maps, titles, ncols=self.ncols, alpha=self.alpha, cmap=self.cmap)
        pixels = _figure_pixels(fig)  # (H, W, 3) uint8
        epoch, step = trainer.current_epoch, trainer.global_step
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="val/rollout", images=[pixels], step=step, caption=[f"epoch {epoch}"])
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("val/rollout", pixels, global_step=step, dataformats="HWC")
        root = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "rollout"
        save_figure(fig, root / f"epoch_{epoch:03d}.png")

    def compute(self, pl_module: L.LightningModule) -> tuple[Tensor, list[str]]:
        """Rollout maps (B, h, w) of the fixed images, and one title per image."""
        net = _vit(pl_module)
        x = self.images.to(pl_module.device)
        # rollout_for_model asks forward_features for the weights (explicit path, this call only), in eval mode
        maps = rollout_for_model(net, x, head_fusion=self.head_fusion, discard_ratio=self.discard_ratio).cpu()
        truth = self.labels or [None] * len(x)
        if getattr(net, "num_classes", 0) > 0:  # a classifier: name its prediction too
            with torch.no_grad(), eval_mode(net):
                pred = net(x).argmax(dim=-1).tolist()
            titles = [f"pred {p}" + ("" if y is None else f" / true {y}") for p, y in zip(pred, truth)]
        else:
            titles = [f"image {i}" if y is None else f"true {y}" for i, y in enumerate(truth)]
        return maps, titles

    off = False  # True for a run whose network has no ViT to explain (set at fit start)

    def _display(self, trainer: L.Trainer) -> Tensor:
        dm = trainer.datamodule
        mean = self.mean if self.mean is not None else getattr(dm, "mean", None)
        std = self.std if self.std is not None else getattr(dm, "std", None)
        if mean is None or std is None:  # the caption data sets normalise with ImageNet statistics
            mean, std = IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
        # grayscale data fed to an RGB model arrives repeated to 3 channels: show the first
        return unnormalize(self.images[:, : len(mean)], mean, std)


def _vit(pl_module: L.LightningModule):
    """The ViT to explain: the network validation runs (``eval_net``: the EMA copy when the
    classifier keeps one), a captioner's encoder; None for a network with neither (an MAE)."""
    net = getattr(pl_module, "eval_net", pl_module.net)
    return net if hasattr(net, "forward_features") else getattr(net, "encoder", None)


def _figure_pixels(fig) -> np.ndarray:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()  # (H, W, 3) uint8

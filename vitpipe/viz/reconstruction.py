"""What an MAE reconstructs: the paper's Figure 2 for a fixed set of validation images.

Per image, four panels: the original | the masked input (hidden patches grey) | the reconstruction |
the reconstruction with the visible patches pasted back. With ``norm_pix_loss`` the network predicts
each patch normalised by its own mean and variance; the panels undo that with the target patch's own
statistics (as the MAE paper's visualisation does), so what is shown is in pixel space.

``ReconstructionCallback`` draws it every ``every_n_epochs`` validation epochs and at the end of
fitting: ``<run>/report/reconstruction.png`` (the newest) and ``<run>/report/reconstruction/epoch_XXX.png``,
and as a wandb / TensorBoard image when those loggers are on; at the end also ``<run>/report/curves.png``
(the reconstruction loss per epoch, from history.csv's rows); rank 0 only.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torch import Tensor

from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write, save_figure
from vitpipe.viz.overlay import unnormalize

PANELS = ("original", "masked", "reconstruction", "reconstruction + visible")


@torch.no_grad()
def reconstruction_panels(net, imgs: Tensor, *, mask_ratio: float = 0.75, noise: Tensor | None = None) -> dict:
    """``{panel name: (B, C, H, W)}`` in the network's input space (normalised pixels), and ``mask``.

    net: a ``MaskedAutoencoderViT`` (``forward``, ``patchify``, ``unpatchify``, ``norm_pix_loss``).
    """
    was_training = net.training
    net.eval()
    try:
        _, pred, mask = net(imgs, mask_ratio=mask_ratio, noise=noise)  # pred (B, L, p*q*C), mask (B, L)
    finally:
        net.train(was_training)
    pred = pred.float()
    if getattr(net, "norm_pix_loss", False):  # back to pixels with each target patch's own mean / var
        target = net.patchify(imgs).float()
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        pred = pred * (var + 1.0e-6) ** 0.5 + mean
    hidden = net.unpatchify(mask[..., None].expand_as(pred).float())  # (B, C, H, W), 1 on hidden pixels
    recon = net.unpatchify(pred)
    imgs = imgs.float()
    return {"original": imgs, "masked": imgs * (1 - hidden), "reconstruction": recon,
            "reconstruction + visible": imgs * (1 - hidden) + recon * hidden, "mask": hidden}


def reconstruction_figure(panels: dict, mean, std, *, title: str | None = None):
    """One row per image, one column per panel, un-normalised with the data's ``mean``/``std``
    (hidden patches of the masked input shown grey)."""
    import matplotlib.pyplot as plt

    n = panels["original"].shape[0]
    fig, axes = plt.subplots(n, len(PANELS), figsize=(2.0 * len(PANELS), 2.0 * n), squeeze=False)
    grey = torch.full_like(panels["original"][:, :1], 0.5)
    for col, name in enumerate(PANELS):
        shown = unnormalize(panels[name][:, : len(mean)].cpu(), mean, std)  # (B, C, H, W) in [0, 1]
        if name == "masked":
            hidden = panels["mask"][:, :1].cpu()
            shown = shown * (1 - hidden) + grey.cpu() * hidden
        for row in range(n):
            ax = axes[row][col]
            image = shown[row].permute(1, 2, 0).numpy()  # (H, W, C)
            ax.imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray" if image.shape[-1] == 1 else None,
                      vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


class ReconstructionCallback(L.Callback):
    """Every ``every_n_epochs`` validation epochs (counted from 0) and when fitting ends, draw the
    reconstruction panels of the first ``num_images`` validation images (kept from the first
    validation run on), with masks drawn from ``seed``: the same patches hidden every time.

    Args:
        every_n_epochs: draw on epochs 0, n, 2n, ... and at the end of fitting.
        num_images: validation images to follow.
        mask_ratio: None = the module's own ``mask_ratio``.
        seed: seeds the masks of the figure.
        dirpath: None = ``<trainer.default_root_dir>/report``.
    """

    def __init__(self, *, every_n_epochs: int = 5, num_images: int = 8, mask_ratio: float | None = None,
                 seed: int = 0, dirpath: str | None = None) -> None:
        if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 1:
            raise ConfigError(f"callbacks.reconstruction.every_n_epochs={every_n_epochs!r}: use an int >= 1")
        if not isinstance(num_images, int) or isinstance(num_images, bool) or num_images < 1:
            raise ConfigError(f"callbacks.reconstruction.num_images={num_images!r}: use an int >= 1")
        self.every_n_epochs, self.num_images, self.mask_ratio = every_n_epochs, num_images, mask_ratio
        self.seed, self.dirpath = seed, dirpath
        self.images: Tensor | None = None  # (num_images, C, H, W) model inputs on the CPU
        self.written: Path | None = None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if dataloader_idx != 0 or self.images is not None and len(self.images) >= self.num_images:
            return
        x = (batch["images"] if isinstance(batch, dict) else batch[0]).detach().float().cpu()
        need = self.num_images - (0 if self.images is None else len(self.images))
        self.images = x[:need] if self.images is None else torch.cat([self.images, x[:need]])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.current_epoch % self.every_n_epochs == 0:
            self.draw(trainer, pl_module, trainer.current_epoch)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer, pl_module, max(trainer.current_epoch - 1, 0))  # the last epoch trained
        self.draw_curves(trainer)

    def draw_curves(self, trainer: L.Trainer) -> Path | None:
        """``<report>/curves.png``: train and val reconstruction loss per epoch, from the run's history
        (the ``HistoryCallback`` rows that history.csv holds)."""
        from vitpipe.report.figures import curves_figure
        from vitpipe.report.history import HistoryCallback

        history = next((c for c in trainer.callbacks if isinstance(c, HistoryCallback)), None)
        if history is None or not history.rows or not trainer.is_global_zero:
            return None
        return save_figure(curves_figure(history.rows), self._root(trainer) / "curves.png")

    def _root(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "report"

    def draw(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int) -> Path | None:
        if self.images is None or not trainer.is_global_zero:
            return None
        net = pl_module.net
        ratio = self.mask_ratio if self.mask_ratio is not None else getattr(pl_module.hparams, "mask_ratio", 0.75)
        x = self.images.to(pl_module.device)
        h, w = net.patch_embed.grid_size
        noise = torch.rand(len(x), h * w, generator=torch.Generator().manual_seed(self.seed)).to(x.device)
        panels = reconstruction_panels(net, x, mask_ratio=ratio, noise=noise)
        dm = trainer.datamodule
        mean, std = getattr(dm, "mean", None), getattr(dm, "std", None)
        if mean is None or std is None:
            mean, std = (0.0,) * x.shape[1], (1.0,) * x.shape[1]
        step = trainer.global_step
        fig = reconstruction_figure(panels, mean, std, title=f"epoch {epoch}, step {step}, mask ratio {ratio}")
        for logger in trainer.loggers:
            if isinstance(logger, (WandbLogger, TensorBoardLogger)):
                fig.canvas.draw()
                pixels = torch.frombuffer(bytearray(fig.canvas.buffer_rgba()), dtype=torch.uint8)
                pixels = pixels.reshape(fig.canvas.get_width_height()[::-1] + (4,))[..., :3].numpy()
                if isinstance(logger, WandbLogger):
                    logger.log_image(key="val/reconstruction", images=[pixels], step=step, caption=[f"epoch {epoch}"])
                else:
                    logger.experiment.add_image("val/reconstruction", pixels, global_step=step, dataformats="HWC")
        root = self._root(trainer)
        drawn = save_figure(fig, root / "reconstruction" / f"epoch_{epoch:03d}.png")
        png = drawn.read_bytes()
        atomic_write(root / "reconstruction.png", lambda f: f.write(png))  # the newest, beside the report
        self.written = root / "reconstruction.png"
        return self.written

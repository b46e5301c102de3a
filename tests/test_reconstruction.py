"""The MAE reconstruction figure (vitpipe/viz/reconstruction.py): panels in pixel space, a PNG per draw."""

from __future__ import annotations

import torch
from PIL import Image

from vitpipe.models.mae import MaskedAutoencoderViT
from vitpipe.viz.reconstruction import PANELS, ReconstructionCallback, reconstruction_figure, reconstruction_panels


def tiny(**kw) -> MaskedAutoencoderViT:
    torch.manual_seed(0)
    return MaskedAutoencoderViT(img_size=8, patch_size=2, in_chans=3, embed_dim=32, depth=1, num_heads=2,
                                decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, **kw)


def test_panels_keep_the_visible_patches_and_undo_norm_pix_loss():
    x = torch.randn(2, 3, 8, 8)
    noise = torch.rand(2, 16, generator=torch.Generator().manual_seed(1))
    for norm_pix in (False, True):
        net = tiny(norm_pix_loss=norm_pix)
        p = reconstruction_panels(net, x, mask_ratio=0.75, noise=noise)
        hidden = p["mask"]
        assert hidden[:, 0].sum(dim=(1, 2)).tolist() == [4.0 * 12] * 2  # 12 of 16 2x2 patches hidden
        visible = hidden == 0
        torch.testing.assert_close(p["reconstruction + visible"][visible], x[visible])  # pasted back as they were
        torch.testing.assert_close(p["reconstruction + visible"][~visible], p["reconstruction"][~visible])
        assert torch.equal(p["masked"][~visible], torch.zeros_like(x)[~visible])
        _, pred, _ = net.eval()(x, mask_ratio=0.75, noise=noise)
        if norm_pix:  # in pixel space: the prediction rescaled by each target patch's own mean and std
            t = net.patchify(x)
            want = pred * (t.var(-1, keepdim=True) + 1e-6) ** 0.5 + t.mean(-1, keepdim=True)
        else:
            want = pred
        torch.testing.assert_close(p["reconstruction"], net.unpatchify(want))


def test_figure_has_a_row_per_image_and_a_column_per_panel():
    net = tiny()
    p = reconstruction_panels(net, torch.randn(3, 3, 8, 8), mask_ratio=0.5)
    fig = reconstruction_figure(p, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), title="t")
    assert len(fig.axes) == 3 * len(PANELS) and [a.get_title() for a in fig.axes[:4]] == list(PANELS)


def test_callback_writes_the_newest_and_one_png_per_draw(tmp_path):
    class Module:  # what the callback reads of a LightningModule
        def __init__(self):
            self.net, self.device = tiny(), torch.device("cpu")
            self.hparams = type("H", (), {"mask_ratio": 0.75})()

    class Trainer:
        is_global_zero, sanity_checking, loggers, global_step = True, False, [], 7
        default_root_dir = str(tmp_path)
        datamodule = type("D", (), {"mean": (0.5,) * 3, "std": (0.5,) * 3})()

        def __init__(self, epoch):
            self.current_epoch = epoch

    cb = ReconstructionCallback(every_n_epochs=2, num_images=3)
    module = Module()
    for i in range(2):  # two validation batches of 2: the first 3 images are kept
        cb.on_validation_batch_end(Trainer(0), module, None, (torch.randn(2, 3, 8, 8), torch.zeros(2)), i)
    assert cb.images.shape == (3, 3, 8, 8)
    for epoch in (0, 1, 2):
        cb.on_validation_epoch_end(Trainer(epoch), module)
    written = sorted(p.name for p in (tmp_path / "report" / "reconstruction").iterdir())
    assert written == ["epoch_000.png", "epoch_002.png"]  # every 2nd epoch
    with Image.open(tmp_path / "report" / "reconstruction.png") as im:
        assert im.size == (800, 600)  # 4 panels x 3 rows of 2 in at 100 dpi


def test_loss_curves_of_a_run_without_accuracy_have_the_loss_panel_alone():
    """An MAE's history.csv has losses only: one panel, half the width, not an empty accuracy axis."""
    from vitpipe.report.figures import CURVES_SIZE, curves_figure

    losses = [{"epoch": e, "train/loss": 1.0 / (e + 1), "val/loss": 1.2 / (e + 1)} for e in range(3)]
    fig = curves_figure(losses)
    assert [ax.get_title() for ax in fig.axes] == ["Loss"] and len(fig.axes[0].lines) == 2
    assert tuple(fig.get_size_inches()) == (CURVES_SIZE[0] / 2, CURVES_SIZE[1])
    both = curves_figure([{**r, "val/acc": 0.5} for r in losses])
    assert [ax.get_title() for ax in both.axes] == ["Loss", "Accuracy"]
    assert tuple(both.get_size_inches()) == tuple(CURVES_SIZE)

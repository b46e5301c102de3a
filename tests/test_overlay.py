"""Overlays: images of any common form, heatmap placement, PNG output."""

import numpy as np
import pytest
import torch
from matplotlib import colormaps
from PIL import Image

from vitpipe.viz.overlay import (
    overlay,
    overlay_grid,
    save_figure,
    save_overlay,
    to_numpy_image,
    unnormalize,
    upsample_heatmap,
)

H, W = 48, 64  # non-square on purpose


def heat_with_peak(h=6, w=8, at=(4, 2)):
    heat = torch.zeros(h, w)
    heat[at] = 1.0
    return heat


def test_png_has_image_size_and_hottest_pixel_over_heatmap_max(tmp_path):
    image = torch.full((3, H, W), 0.5)  # uniform gray, so only the heatmap varies
    heat = heat_with_peak()  # peak in cell (row 4, col 2) of a 6x8 grid -> 8x8 px cells
    path = save_overlay(image, heat, tmp_path / "sub" / "overlay.png", alpha=0.6)
    png = np.asarray(Image.open(path).convert("RGB")).astype(np.float32) / 255.0
    assert png.shape == (H, W, 3)
    # the hottest pixel is the one closest to the colour of the map's maximum (jet(1), blended)
    hottest = 0.4 * 0.5 + 0.6 * np.asarray(colormaps["jet"](1.0)[:3])
    dist = np.abs(png - hottest).sum(-1)
    row, col = np.unravel_index(dist.argmin(), dist.shape)
    assert 4 * 8 <= row < 5 * 8 and 2 * 8 <= col < 3 * 8
    assert dist.min() < 0.02
    # and the far corner shows the coldest colour
    coldest = 0.4 * 0.5 + 0.6 * np.asarray(colormaps["jet"](0.0)[:3])
    assert np.abs(png[0, -1] - coldest).sum() < 0.02


def test_overlay_returns_blend_and_draws_on_axes():
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    image = np.zeros((H, W, 3), dtype=np.uint8)  # black HWC uint8
    out = overlay(image, heat_with_peak(), alpha=1.0, cmap="gray", ax=ax)
    assert out.shape == (H, W, 3) and out.min() >= 0 and out.max() <= 1
    row, col = np.unravel_index(out.sum(-1).argmax(), out.shape[:2])
    assert 32 <= row < 40 and 16 <= col < 24
    assert len(ax.images) == 1 and not ax.axison


@pytest.mark.parametrize(
    "image",
    [
        torch.rand(3, H, W),
        (torch.rand(3, H, W) * 255).to(torch.uint8),
        torch.rand(1, H, W),
        torch.rand(H, W),
        Image.new("RGB", (W, H), (255, 0, 0)),
        Image.new("L", (W, H), 128),
        np.random.rand(H, W, 3).astype(np.float32),
        np.zeros((H, W, 4), dtype=np.uint8),
    ],
)
def test_image_forms(image):
    array = to_numpy_image(image)
    assert array.shape == (H, W, 3) and array.dtype == np.float32
    assert array.min() >= 0.0 and array.max() <= 1.0


def test_pil_and_uint8_are_scaled():
    assert np.allclose(to_numpy_image(Image.new("RGB", (4, 4), (255, 0, 0)))[0, 0], [1, 0, 0])
    assert np.allclose(to_numpy_image(torch.full((3, 2, 2), 51, dtype=torch.uint8)), 0.2)


def test_upsample_heatmap_min_max_and_constant():
    up = upsample_heatmap(torch.tensor([[1.0, 3.0], [5.0, 9.0]]), (8, 8))
    assert up.shape == (8, 8) and up.min() == 0.0 and up.max() == 1.0
    assert up[7, 7] == 1.0 and up[0, 0] == 0.0  # corners keep the corner cells' values
    assert (upsample_heatmap(torch.full((2, 2), 4.0), (8, 8)) == 0).all()


def test_unnormalize_inverts_normalize():
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    x = torch.rand(2, 3, 5, 5)
    normalized = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    torch.testing.assert_close(unnormalize(normalized, mean, std), x)
    torch.testing.assert_close(unnormalize(normalized[0], mean, std), x[0])
    with pytest.raises(ValueError, match="3 channels"):
        unnormalize(normalized, (0.5,) * 2, (0.5,) * 2)


def test_overlay_grid_and_save_figure(tmp_path):
    images = torch.rand(5, 3, 16, 16)
    heats = torch.rand(5, 4, 4)
    fig = overlay_grid(images, heats, titles=[f"c{i}" for i in range(5)], ncols=3)
    axes = fig.get_axes()
    assert len(axes) == 6  # 2 rows x 3 columns, the last one empty
    assert [len(ax.images) for ax in axes] == [1, 1, 1, 1, 1, 0]
    assert axes[4].get_title() == "c4"
    path = save_figure(fig, tmp_path / "grid.png", dpi=50)
    with Image.open(path) as png:
        assert png.format == "PNG"
        # figure size 3 x 2.5 in wide, 2 x 2.5 in high, at 50 dpi
        assert png.size == (375, 250)


def test_bad_overlay_arguments():
    with pytest.raises(ValueError, match="nope"):
        overlay(torch.rand(3, 8, 8), torch.rand(2, 2), cmap="nope")
    with pytest.raises(ValueError, match="1.5"):
        overlay(torch.rand(3, 8, 8), torch.rand(2, 2), alpha=1.5)
    with pytest.raises(ValueError, match="3 images but 2 heatmaps"):
        overlay_grid(torch.rand(3, 3, 8, 8), torch.rand(2, 2, 2))
    with pytest.raises(ValueError, match=r"\(h, w\)"):
        overlay(torch.rand(3, 8, 8), torch.rand(1, 2, 2))


@pytest.mark.parametrize("where", ["vitpipe.viz", "vitpipe.report.figures"])
def test_save_figure_is_atomic(tmp_path, where):
    """A figure whose drawing fails half way leaves the earlier PNG as it was and no partial file."""
    import importlib

    from matplotlib.figure import Figure

    save_figure = importlib.import_module(where).save_figure
    path = tmp_path / "fig.png"
    good = Figure(figsize=(2, 1))
    good.add_subplot().plot([0, 1], [1, 0])
    save_figure(good, path)
    before = path.read_bytes()
    with Image.open(path) as png:
        assert png.size == (200, 100)  # 2 x 1 in at the default 100 dpi

    bad = Figure(figsize=(2, 1))
    real = bad.savefig

    def half_then_fail(fname, **kw):
        real(fname, **kw)  # the PNG's bytes went out ...
        raise RuntimeError("killed while writing")  # ... but the write did not finish

    bad.savefig = half_then_fail
    with pytest.raises(RuntimeError, match="killed"):
        save_figure(bad, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]  # no temporary file left behind


def test_save_overlay_is_atomic(tmp_path, monkeypatch):
    """An overlay PNG whose write fails half way leaves the earlier file as it was and no partial file."""
    path = save_overlay(torch.rand(3, 8, 8), torch.rand(2, 2), tmp_path / "o.png")
    before = path.read_bytes()
    real = Image.Image.save

    def half_then_fail(self, fp, *a, **kw):
        real(self, fp, *a, **kw)
        raise RuntimeError("killed while writing")

    monkeypatch.setattr(Image.Image, "save", half_then_fail)
    with pytest.raises(RuntimeError, match="killed"):
        save_overlay(torch.rand(3, 8, 8), torch.rand(2, 2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["o.png"]

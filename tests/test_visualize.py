"""Attention figures from checkpoints (scripts/visualize_attention.py) and the RolloutCallback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_cfg
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.models.vit import ViT
from vitpipe.run.checkpoint import load_from_checkpoint
from vitpipe.run.paths import resolve_ckpt_path
from vitpipe.tasks import visualize as viz
from vitpipe.tasks.train import train
from vitpipe.viz.rollout import attention_rollout, rollout_for_model

ROOT = Path(__file__).resolve().parents[1]
DPI, PANEL = 100, 2.5  # figure defaults: a panel is 250 px square


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as im:
        return im.size  # (width, height)


def _train_checkpoint(tmp: Path, *overrides: str) -> Path:
    cfg = make_cfg(tmp, ["debug=fast", "test=false", *overrides])
    train(cfg)
    ckpts = sorted((Path(cfg.paths.output_dir) / "checkpoints").glob("*.ckpt"))
    return [p for p in ckpts if p.name != "last.ckpt"][0]


@pytest.fixture(scope="module")
def classifier_ckpt(tmp_path_factory) -> Path:
    return _train_checkpoint(tmp_path_factory.mktemp("clf"), "model=vit_micro", "model.dim=32", "model.num_heads=2",
                             "model.depth=2")


@pytest.fixture(scope="module")
def captioner_ckpt(tmp_path_factory) -> Path:
    return _train_checkpoint(tmp_path_factory.mktemp("cap"), "experiment=caption_shapes", "data.num_train=64",
                             "data.num_val=16", "data.num_test=16", "trainer.limit_train_batches=1")


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """Three images of different sizes and modes, and a file that is not an image."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(folder / "b_rgb.png")
    Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(folder / "a_gray.png")
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / "c_big.jpg")
    (folder / "notes.txt").write_text("not an image")
    return folder


def viz_cfg(tmp_path: Path, ckpt, images, *overrides: str):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={images}", f"out={tmp_path / 'out'}", *overrides],
                    config_name="visualize")


# ---------------------------------------------------------------- loading


def test_train_stores_the_run_config_in_checkpoints(tmp_path):
    cfg = make_cfg(tmp_path, ["debug=fast", "test=false", "trainer.limit_train_batches=1"])
    train(cfg)
    ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert "vitpipe_config" in ckpt, "train() must pass ConfigInCheckpoint to the Trainer (the config travels with it)"
    assert ckpt["vitpipe_config"]["model"]["dim"] == cfg.model.dim


def test_load_classifier_checkpoint(classifier_ckpt):
    net, train_cfg, dm = load_from_checkpoint(classifier_ckpt)
    state = torch.load(classifier_ckpt, weights_only=True)["state_dict"]
    assert isinstance(net, ViT) and not net.training and not any(m.training for m in net.modules())
    assert (net.dim, len(net.blocks), net.num_classes) == (32, 2, 10)
    for k, v in net.state_dict().items():
        assert torch.equal(v, state[f"net.{k}"]), k
    assert type(dm).__name__ == "DigitsDataModule" and dm.mean == (0.3053,)
    assert train_cfg.model.name == "vit_micro"


def test_load_captioner_checkpoint_uses_its_tokenizer(captioner_ckpt):
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.text import WordTokenizer

    net, _, dm = load_from_checkpoint(captioner_ckpt)
    tok = WordTokenizer.from_state_dict(load_checkpoint(captioner_ckpt)["tokenizer"])  # the one stored
    assert net.vocab_size == tok.vocab_size and dm.tokenizer.itos == tok.itos
    assert dm._data == {}  # the vocabulary came from the checkpoint: no split was generated
    ids = net.generate(torch.zeros(2, 3, 32, 32), max_len=5)
    assert ids.shape[0] == 2 and int(ids.max()) < tok.vocab_size


# ---------------------------------------------------------------- the script


def test_folder_of_images_all_methods(tmp_path, classifier_ckpt, image_folder, monkeypatch):
    suptitles = []
    real_panel_figure = viz.panel_figure

    def spy(image, heatmaps, titles, **kw):
        suptitles.append(kw.get("suptitle"))
        return real_panel_figure(image, heatmaps, titles, **kw)

    monkeypatch.setattr(viz, "panel_figure", spy)
    written = viz.visualize(viz_cfg(tmp_path, classifier_ckpt, image_folder, "method=all"))
    out = tmp_path / "out"
    assert sorted(written) == sorted(out.rglob("*.png"))
    names = ["000_a_gray", "001_b_rgb", "002_c_big"]  # sorted by name; the .txt is skipped
    for kind, panels in (("rollout", 2), ("gradient", 2), ("heads", 3)):  # input + maps (2 heads)
        assert sorted(p.stem for p in (out / kind).glob("*.png")) == names
        assert png_size(out / kind / f"{names[0]}.png") == (panels * 250, 250)
    assert png_size(out / "rollout_grid.png") == (3 * 250, 250)  # 3 images in one row
    assert png_size(out / "heads_grid.png") == (2 * 250, 3 * 250)  # one row per image, one column per head
    assert len(written) == 3 * 3 + 3

    # titles name the predicted class, the argmax of the network on the preprocessed images
    net, _, dm = load_from_checkpoint(classifier_ckpt)
    images = viz.folder_images(image_folder, None, encoder=net, mean=dm.mean, std=dm.std, channels=1)
    pred = net(images.x).argmax(-1).tolist()
    assert all(s.startswith(f"pred {p} (") for s, p in zip(suptitles[1::3], pred))  # the gradient figures


def test_folder_images_are_preprocessed_like_the_data(classifier_ckpt, image_folder):
    net, _, dm = load_from_checkpoint(classifier_ckpt)
    images = viz.folder_images(image_folder, 2, encoder=net, mean=dm.mean, std=dm.std, channels=1)
    assert images.x.shape == (2, 1, 32, 32) and images.names == ["000_a_gray", "001_b_rgb"]
    gray = np.asarray(Image.open(image_folder / "a_gray.png"), dtype=np.float32) / 255  # (8, 8)
    expect = F.interpolate(torch.from_numpy(gray)[None, None], size=(32, 32), mode="bilinear", align_corners=False)
    assert torch.allclose(images.x[:1], (expect - 0.3053) / 0.3759, atol=1e-5)
    assert torch.allclose(images.display[:1], expect.clamp(0, 1), atol=1e-5)
    # the maps drawn are the model's rollout of exactly these inputs
    maps = viz.classifier_maps(net, images.x, ["rollout"], head_fusion="mean", discard_ratio=0.0)
    assert torch.allclose(maps["rollout"], rollout_for_model(net, images.x))
    assert torch.allclose(maps["probs"].sum(-1), torch.ones(2))


def test_16_bit_folder_images_are_not_white(tmp_path, classifier_ckpt):
    """A 16-bit gray PNG (values around 1/4 of 65535) reads as dark gray, as the data sets read it (open_image)."""
    folder = tmp_path / "sixteen"
    folder.mkdir()
    Image.fromarray(np.full((16, 16), 16000, dtype=np.uint16)).save(folder / "a.png")
    net, _, dm = load_from_checkpoint(classifier_ckpt)
    images = viz.folder_images(folder, None, encoder=net, mean=dm.mean, std=dm.std, channels=1)
    assert images.display.mean().item() == pytest.approx((16000 >> 8) / 255, abs=1e-3)  # not 1.0 (white)


def test_test_split(tmp_path, classifier_ckpt):
    written = viz.visualize(viz_cfg(tmp_path, classifier_ckpt, "test", "num_images=5", "method=rollout", "ncols=2"))
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "rollout").glob("*.png")) == [f"test_{i:04d}.png" for i in range(5)]
    assert png_size(out / "rollout_grid.png") == (2 * 250, 3 * 250)  # 5 images, 2 columns
    assert len(written) == 6


def test_run_directory_resolves_to_its_best_checkpoint(classifier_ckpt):
    assert resolve_ckpt_path(classifier_ckpt.parent.parent, which="best") == classifier_ckpt


def test_captioner_one_overlay_per_word(tmp_path, captioner_ckpt, monkeypatch):
    seen = []
    real_caption_maps = viz.caption_maps

    def spy(net, tokenizer, x, max_words):
        words, maps = real_caption_maps(net, tokenizer, x, max_words)
        seen.extend(zip(words, maps))
        return words, maps

    monkeypatch.setattr(viz, "caption_maps", spy)
    viz.visualize(viz_cfg(tmp_path, captioner_ckpt, "test", "num_images=3", "method=all", "max_words=4"))
    out = tmp_path / "out"
    for kind in ("caption", "rollout", "heads"):
        assert len(list((out / kind).glob("*.png"))) == 3 and (out / f"{kind}_grid.png").is_file()
    assert len(seen) == 3
    for i, (words, maps) in enumerate(seen):
        assert len(words) <= 4 and maps.shape == (len(words), 8, 8)  # vit_micro: 32 px / patch 4
        # a word's attention over the patches: the softmax row without the class token's share
        assert (maps >= 0).all() and (maps.sum((-2, -1)) <= 1 + 1e-5).all()
        width, height = png_size(out / "caption" / f"test_{i:04d}.png")
        n = 1 + len(words)  # the input, then one panel per word, 6 to a row
        assert (width, height) == (min(n, 6) * 250, -(-n // 6) * 250)


def test_cli(tmp_path, classifier_ckpt, image_folder):
    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "visualize_attention.py"), *args,
                               f"paths.log_dir={tmp_path / 'logs'}"], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    r = run(f"ckpt_path={classifier_ckpt}", f"images={image_folder}", f"out={tmp_path / 'cli'}", "method=gradient")
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list((tmp_path / "cli" / "gradient").glob("*.png"))) == 3
    assert (tmp_path / "cli" / "gradient_grid.png").is_file()
    assert "attention maps" in r.stderr  # the tqdm bar


def test_cli_error_is_one_line(tmp_path, classifier_ckpt, image_folder, capsys):
    from vitpipe.tasks.cli import run_cli

    with pytest.raises(SystemExit) as stop:
        run_cli(viz.visualize, viz_cfg(tmp_path, classifier_ckpt, image_folder, "method=attention"))
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("vitpipe: error: method='attention' is not valid; "
                          "choose one of ['rollout', 'gradient', 'heads', 'all']")


# ---------------------------------------------------------------- bad input


def test_bad_input_one_clear_error(tmp_path, classifier_ckpt, captioner_ckpt, image_folder):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ((tmp_path / "missing.ckpt", image_folder), r"ckpt_path=.*missing.ckpt: no such file"),
        ((classifier_ckpt, empty), r"images=.*empty holds no images \(.png, .jpg"),
        ((classifier_ckpt, tmp_path / "nowhere"), r"images=.*nowhere: neither a folder nor a data split.*'val'"),
        ((classifier_ckpt, "train"), r"images=train: neither a folder nor a data split"),
        ((classifier_ckpt, image_folder, "method=attention"), r"method='attention' is not valid; choose one of"),
        ((classifier_ckpt, image_folder, "head_fusion=median"), r"head_fusion='median' is not valid.*'mean', 'max'"),
        ((classifier_ckpt, image_folder, "discard_ratio=1.0"), r"discard_ratio=1.0 is not valid; use a number in \["),
        ((classifier_ckpt, image_folder, "num_images=0"), r"num_images=0 is not valid"),
        ((classifier_ckpt, image_folder, "device=tpu9"), r"device='tpu9' is not available here; use auto, cpu"),
        ((captioner_ckpt, image_folder, "method=gradient"), r"method=gradient needs a class logit.*captioner"),
    ]
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    cases.append(((garbage, image_folder), r"cannot read checkpoint .*garbage.ckpt"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.png").write_bytes(b"\x89PNG not really")
    cases.append(((classifier_ckpt, broken), r"cannot read image .*x.png"))
    for i, ((ckpt, images, *extra), message) in enumerate(cases):
        with pytest.raises(ConfigError, match=message):
            viz.visualize(viz_cfg(tmp_path / str(i), ckpt, images, *extra))
    assert not (tmp_path / "0" / "out").exists()  # nothing written before the error


# ---------------------------------------------------------------- the callback


def test_rollout_callback_during_a_tiny_fit(tmp_path, monkeypatch):
    """Two epochs with callbacks=rollout: PNGs per epoch, same images each time, attention from the
    explicit path on the callback's own forward while every training step stays on SDPA."""
    from lightning.pytorch.loggers import WandbLogger

    from vitpipe.lit.classifier import ImageClassifier

    state = {"training": False, "sdpa_in_training": 0}
    real_sdpa, real_ff, real_step = F.scaled_dot_product_attention, ViT.forward_features, ImageClassifier.training_step
    explicit_calls, wandb_images = [], []

    def counting_sdpa(*args, **kw):
        state["sdpa_in_training"] += state["training"]
        return real_sdpa(*args, **kw)

    def spying_forward_features(self, x, *, return_attn=False):
        out = real_ff(self, x, return_attn=return_attn)
        if return_attn:
            assert not state["training"], "a training step asked for attention weights"
            tokens, attn = out
            with torch.no_grad():
                fused = real_ff(self, x)  # the SDPA path on the same weights and input
            explicit_calls.append({"x": x.detach().clone(), "attn": [a.detach().clone() for a in attn],
                                   "tokens_match": torch.allclose(tokens, fused, atol=1e-5), "eval": not self.training})
        return out

    def flagged_step(self, batch, batch_idx):
        state["training"] = True
        try:
            return real_step(self, batch, batch_idx)
        finally:
            state["training"] = False

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(ViT, "forward_features", spying_forward_features)
    monkeypatch.setattr(ImageClassifier, "training_step", flagged_step)
    monkeypatch.setattr(WandbLogger, "log_image", lambda self, key, images, **kw: wandb_images.append((key, images)))

    from vitpipe.viz.callback import RolloutCallback

    maps_logged = []
    real_compute = RolloutCallback.compute

    def recording_compute(self, pl_module):
        maps, titles = real_compute(self, pl_module)
        maps_logged.append(maps)
        return maps, titles

    monkeypatch.setattr(RolloutCallback, "compute", recording_compute)
    cfg = make_cfg(tmp_path, ["model=vit_micro", "debug=fast", "callbacks=rollout", "callbacks.rollout.num_images=4",
                              "trainer.max_epochs=2", "test=false", "logger=[csv,tensorboard,wandb]"])
    train(cfg)

    run = Path(cfg.paths.output_dir)
    pngs = sorted((run / "rollout").glob("*.png"))
    assert [p.name for p in pngs] == ["epoch_000.png", "epoch_001.png"]
    assert all(png_size(p) == (4 * 250, 250) for p in pngs)

    # training used the fused kernel: one SDPA call per block per step (depth 1, 2 steps x 2 epochs)
    assert state["sdpa_in_training"] == 1 * 2 * 2
    # the callback's own forward: once per epoch, eval mode, the same 4 images both times
    assert len(explicit_calls) == 2 and all(c["eval"] for c in explicit_calls)
    assert explicit_calls[0]["x"].shape == (4, 1, 32, 32)
    assert torch.equal(explicit_calls[0]["x"], explicit_calls[1]["x"])
    for call, maps in zip(explicit_calls, maps_logged):
        assert call["tokens_match"]  # explicit and fused paths agree on the output
        for a in call["attn"]:
            assert (a >= 0).all() and torch.allclose(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-5)
        assert torch.allclose(maps, attention_rollout(call["attn"]))  # the map logged is the rollout of those weights

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert len(events.Images("val/rollout")) == 2
    assert [k for k, _ in wandb_images] == ["val/rollout"] * 2
    assert wandb_images[0][1][0].shape == (250, 1000, 3) and wandb_images[0][1][0].dtype == np.uint8


def test_rollout_callback_bad_options():
    from vitpipe.viz.callback import RolloutCallback

    with pytest.raises(ConfigError, match=r"every_n_epochs=0"):
        RolloutCallback(every_n_epochs=0)
    with pytest.raises(ConfigError, match=r"head_fusion='median'.*\['mean', 'max', 'min'\]"):
        RolloutCallback(head_fusion="median")


# ---------------------------------------------------------------- the figures of the README and docs/

FIGURE_COMMAND = re.compile(r"^python scripts/visualize_attention\.py (.*\bout=(notebooks/figures/\S+).*)$", re.M)


def page_texts() -> list[tuple[Path, str]]:
    """(path, text) of README.md and every docs/ page (the pages whose commands the README test runs)."""
    from readme_commands import pages

    return [(p, p.read_text()) for p in pages() if p.is_file()]


def readme_figure_commands() -> list[tuple[list[str], str]]:
    """(overrides, out folder) of every command the pages show that writes a committed figure."""
    return [(args.split("#")[0].split(), out) for _, text in page_texts() for args, out in FIGURE_COMMAND.findall(text)]


def linked_pngs() -> set[str]:
    """Every PNG the pages link, as a path from the repository root (links are relative to their page)."""
    return {(page.parent / link).resolve().relative_to(ROOT).as_posix()
            for page, text in page_texts() for link in re.findall(r"\]\(([^)\s:]+\.png)\)", text)}


def test_readme_attention_figures_come_from_the_commands_it_shows(tmp_path, classifier_ckpt):
    # the pages name the command that drew each attention figure: every figure they link under that
    # command's out= folder is committed, and the command (on a tiny checkpoint) writes exactly those files
    commands = readme_figure_commands()
    assert len(commands) >= 2, "the pages' Fashion-MNIST figures (0 and 4 registers) lost their commands"
    for i, (overrides, out) in enumerate(commands):
        linked = sorted(p for p in linked_pngs() if p.startswith(out + "/"))
        assert linked, f"no page shows a figure from out={out}"
        for path in linked:
            assert (ROOT / path).is_file(), f"a page links {path}, which is not committed"
        where = tmp_path / f"out{i}"
        args = [a for a in overrides if not a.startswith(("ckpt_path=", "out="))]
        written = viz.visualize(make_cfg(tmp_path, [f"ckpt_path={classifier_ckpt}", f"out={where}", *args],
                                         config_name="visualize"))
        produced = sorted(str(p.relative_to(where)) for p in written)
        assert produced == sorted(p[len(out) + 1:] for p in linked), (out, produced)
        for p in written:
            assert p.is_file() and png_size(p)[0] > 0

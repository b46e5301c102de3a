"""NaFlex checkpoints downstream of training: predict on mixed-aspect files (batched = one at a time),
attention rollout on each image's own grid (padding-invariant), ONNX with a dynamic sequence length and
the timm NaFlexVit export (parity through ``timm.create_model("local-dir:...")``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg
from omegaconf import OmegaConf
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.nn.naflex import pad_batch, seq_grid

MAX_SEQ_LEN = 12
# (H, W) of the files: wide, tall, square, very wide (the checkpoint: 8x8 digits, vit_nano's patches)
SIZES = [(8, 20), (30, 9), (8, 8), (5, 40)]


def naflex_checkpoint(base: Path, pool: str = "mean", pos_embed: str = "learned", *extra: str) -> Path:
    """A tiny classifier checkpoint (random weights, as tests/tiny_checkpoints.py makes them) built through
    ``train.build`` with ``data.naflex.enabled=true``: the config the NaFlex training path stores."""
    from vitpipe.run.build import build_from_config

    root = base / "_".join([pos_embed, pool, *extra]).replace("=", "-")
    overrides = [f"model.pos_embed={pos_embed}", f"model.pool={pool}", f"model.class_token={pool == 'cls'}", *extra]
    naflex = ["data.naflex.enabled=true", f"data.naflex.seq_lens=[{MAX_SEQ_LEN}]", f"data.naflex.max_seq_len={MAX_SEQ_LEN}"]
    cfg = make_cfg(root, ["debug=fast", "logger=none", "model.depth=2", *overrides, *naflex])
    dm, net, module = build_from_config(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.2)
    stored = OmegaConf.to_container(cfg, resolve=True)
    stored.pop("hydra", None)
    assert stored["data"]["naflex"]["enabled"] and stored["data"]["naflex"]["patch_size"] == stored["model"]["patch_size"]
    path = root / "run" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": module.state_dict(), "vitpipe_config": stored,
                "class_names": getattr(dm, "class_names", None)}, path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return naflex_checkpoint(tmp_path_factory.mktemp("naflex_ckpt"))


def image_folder(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for i, (h, w) in enumerate(SIZES):
        mode = "RGB" if i % 2 else "L"
        shape = (h, w, 3) if mode == "RGB" else (h, w)
        files.append(folder / f"img{i}.png")
        Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8), mode).save(files[-1])
    return files


def rebuilt(ckpt):
    from vitpipe.data.preprocess import Preprocess, naflex_settings
    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.stored import load_checkpoint

    checkpoint = load_checkpoint(ckpt)
    built = rebuild(checkpoint, ckpt)
    net = built.net.eval()
    return net, Preprocess(built.datamodule, net, naflex=naflex_settings(checkpoint["vitpipe_config"]))


# --------------------------------------------------------------------------- preprocess + predict


def test_preprocess_keeps_aspect_and_normalises_as_eval(ckpt, tmp_path):
    net, pre = rebuilt(ckpt)
    files = image_folder(tmp_path / "imgs")
    for f, (h, w) in zip(files, SIZES):
        d = pre(Image.open(f))
        n = len(d["patches"])
        gh, gw = (d["patch_coord"].amax(0) + 1).tolist()
        assert n == gh * gw <= MAX_SEQ_LEN and d["patch_valid"].all()
        assert (gh, gw) == seq_grid((h, w), tuple(net.patch_size), MAX_SEQ_LEN)
        # own aspect, never squashed to the model's square grid
        assert (gh, gw) == (3, 3) if h == w else (gw > gh) == (w > h)
    # an image already at a full grid goes in without resampling: its patches are exactly the normalised pixels
    p = net.patch_size[0]
    px = np.random.default_rng(3).integers(0, 255, (3 * p, 4 * p), dtype=np.uint8)  # a 3x4 grid = 12 patches
    d = pre(Image.fromarray(px, "L"))
    ref = (torch.from_numpy(px).float() / 255 - pre._mean[0]) / pre._std[0]  # the digits statistics, as eval
    ref = ref.expand(net.in_chans, 3 * p, 4 * p)
    want = ref.reshape(net.in_chans, 3, p, 4, p).permute(1, 3, 2, 4, 0).reshape(12, -1)  # timm's (p, q, C) order
    assert torch.allclose(d["patches"], want, atol=1e-6)
    assert (d["patch_coord"].amax(0) + 1).tolist() == [3, 4]


def test_predict_batched_equals_one_at_a_time(ckpt, tmp_path):
    from vitpipe.tasks.predict import predict

    folder = tmp_path / "imgs"
    files = image_folder(folder)

    def run(batch_size: int, out: str) -> list[dict]:
        cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={folder}", f"out={tmp_path / out}",
                                  "device=cpu", f"batch_size={batch_size}", "topk=3"], config_name="predict")
        with open(predict(cfg)) as f:
            return list(csv.DictReader(f))

    batched, single = run(4, "b.csv"), run(1, "s.csv")
    assert [r["path"] for r in batched] == [str(f) for f in sorted(files)]
    for a, b in zip(batched, single):
        assert a["label"] == b["label"]
        for k in ("prob", "top2_prob", "top3_prob"):
            assert abs(float(a[k]) - float(b[k])) < 1e-5
    # and the logits themselves: a padded batch of mixed lengths equals each image alone
    net, pre = rebuilt(ckpt)
    items = [pre(Image.open(f)) for f in files]
    assert len({len(it["patches"]) for it in items}) > 1  # really mixed lengths: padding is exercised
    with torch.no_grad():
        together = net(pad_batch(items))
        alone = torch.cat([net(pad_batch([it])) for it in items])
    assert (together - alone).abs().max() < 1e-5
    top = alone.softmax(-1).max(-1).values  # predict went through the patch dicts, not a squash to 8x8
    assert max(abs(float(r["prob"]) - t) for r, t in zip(batched, top.tolist())) < 1e-5


def test_predict_hflip_on_patch_dicts(ckpt):
    """tta=hflip mirrors each image on its own grid: the dict of a mirrored file."""
    from vitpipe.data.preprocess import hflip_patches

    net, pre = rebuilt(ckpt)
    rng = np.random.default_rng(5)
    px = rng.integers(0, 255, (8, 20), dtype=np.uint8)
    items = [pre(Image.fromarray(px, "L")), pre(Image.fromarray(rng.integers(0, 255, (30, 9), dtype=np.uint8), "L"))]
    mirrored = pre(Image.fromarray(px[:, ::-1].copy(), "L"))
    flipped = hflip_patches(pad_batch(items), net.patch_size)
    with torch.no_grad():
        assert (net(flipped)[0] - net(pad_batch([mirrored]))[0]).abs().max() < 1e-5


# --------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_rollout_per_image_grid_ignores_padding(pool, tmp_path):
    from vitpipe.viz.rollout import attention_rollout, naflex_rollout_for_model

    net, pre = rebuilt(naflex_checkpoint(tmp_path, pool=pool))
    rng = np.random.default_rng(7)
    short = pre(Image.fromarray(rng.integers(0, 255, (8, 20), dtype=np.uint8), "L"))
    long_ = pre(Image.fromarray(rng.integers(0, 255, (16, 12), dtype=np.uint8), "L"))
    assert len(short["patches"]) < len(long_["patches"])
    alone = naflex_rollout_for_model(net, pad_batch([short]))[0]
    batched = naflex_rollout_for_model(net, pad_batch([short, long_]))
    gh, gw = (short["patch_coord"].amax(0) + 1).tolist()
    assert alone.shape == (gh, gw) and gh != gw  # the image's own, non-square grid
    assert batched[0].shape == (gh, gw) and batched[1].shape == tuple((long_["patch_coord"].amax(0) + 1).tolist())
    assert torch.allclose(batched[0], alone, atol=1e-6)
    assert alone.std() > 0  # a real map, not a constant
    # and the map of the image alone is the plain rollout on that grid (no padding to drop)
    with torch.no_grad():
        _, att = net.forward_features(pad_batch([short]), return_attn=True)
    plain = attention_rollout(att, num_prefix_tokens=net.num_prefix_tokens, grid_size=(gh, gw),
                              query="cls" if pool == "cls" else "mean")[0]
    assert torch.allclose(alone, plain, atol=1e-6)


# --------------------------------------------------------------------------- export: timm NaFlexVit


def export_cfg(tmp_path, ckpt, fmt: str, out: Path):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"format={fmt}", f"out={out}"], config_name="export")


@pytest.mark.parametrize("pos_embed, pool", [("learned", "mean"), ("learned2d", "mean"), ("learned", "cls")])
def test_export_timm_naflexvit_same_logits(pos_embed, pool, tmp_path):
    import timm

    from vitpipe.tasks.export import export

    ckpt = naflex_checkpoint(tmp_path, pool=pool, pos_embed=pos_embed)
    out = export(export_cfg(tmp_path, ckpt, "timm", tmp_path / "timm_out"))
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert type(loaded).__name__ == "NaFlexVit"
    assert json.loads((out / "config.json").read_text())["naflex"]["max_seq_len"] == MAX_SEQ_LEN
    net, pre = rebuilt(ckpt)
    files = image_folder(tmp_path / "imgs")
    batch = pad_batch([pre(Image.open(f)) for f in files])
    with torch.no_grad():
        want, got = net(batch), loaded(batch)
    assert want.std(0).max() > 0.01  # the images get different logits: a real comparison
    assert (got - want).abs().max() < 1e-5


def test_export_timm_naflex_refuses_what_naflexvit_lacks(tmp_path):
    from vitpipe.tasks.export import export

    ckpt = naflex_checkpoint(tmp_path, pos_embed="sincos2d")
    out = tmp_path / "timm_out"
    with pytest.raises(ConfigError, match="NaFlexVit cannot express pos_embed=.*SinCos") as e:
        export(export_cfg(tmp_path, ckpt, "timm", out))
    assert len(str(e.value).splitlines()) == 1 and not out.exists()


# --------------------------------------------------------------------------- export: ONNX, dynamic sequence length


@pytest.mark.parametrize("pos_embed, pool", [("learned2d", "cls")])
def test_export_onnx_dynamic_sequence_length(pos_embed, pool, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from vitpipe.tasks.export import export

    ckpt = naflex_checkpoint(tmp_path, pool=pool, pos_embed=pos_embed)
    out = export(export_cfg(tmp_path, ckpt, "onnx", tmp_path / "m.onnx"))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["patches", "patch_coord", "patch_valid"]
    net, pre = rebuilt(ckpt)
    files = image_folder(tmp_path / "imgs")
    items = [pre(Image.open(f)) for f in files]
    batches = [pad_batch(items), pad_batch(items[:1]), pad_batch(items[2:3], seq_len=MAX_SEQ_LEN + 3)]
    assert len({b["patches"].shape[1] for b in batches}) == 3  # three sequence lengths, batch sizes 4 and 1
    for b in batches:
        got = torch.from_numpy(session.run(None, {k: v.numpy() for k, v in b.items()})[0])
        with torch.no_grad():
            want = net(b)
        assert (got - want).abs().max() < 1e-4


def test_export_onnx_naflex_with_rotary_positions_is_refused_in_one_line(tmp_path):
    """The ONNX graph reads each grid's additive positions from a table; model.rope=true (EVA-02's rotary phases
    beside the table) rotates q/k per grid, which that graph leaves out: refused, nothing written."""
    from vitpipe.tasks.export import export

    ckpt = naflex_checkpoint(tmp_path, "mean", "learned", "model.rope=true")
    out = tmp_path / "m.onnx"
    with pytest.raises(ConfigError, match="model.rope=true rotates q/k per image grid") as e:
        export(export_cfg(tmp_path, ckpt, "onnx", out))
    assert len(str(e.value).splitlines()) == 1 and not out.exists()


def test_visualize_naflex_draws_each_image_at_its_aspect(ckpt, tmp_path):
    from vitpipe.tasks.visualize import visualize
    from vitpipe.viz.inputs import naflex_display

    folder = tmp_path / "imgs"
    image_folder(folder)
    cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={folder}", f"out={tmp_path / 'viz'}", "device=cpu",
                              "method=rollout", "batch_size=3"], config_name="visualize")
    written = visualize(cfg)
    assert sorted(p.name for p in written) == sorted([*(f"{i:03d}_img{i}.png" for i in range(4)), "rollout_grid.png"])
    # the display is the model's input at its own grid: a full-grid file comes back as its own pixels
    net, pre = rebuilt(ckpt)
    p = net.patch_size[0]
    px = np.random.default_rng(4).integers(0, 255, (2 * p, 5 * p), dtype=np.uint8)  # a 2x5 grid
    shown = naflex_display(pre(Image.fromarray(px, "L")), net.patch_size, pre._mean, pre._std, 1)
    assert shown.shape == (1, 2 * p, 5 * p)
    assert torch.allclose(shown[0], torch.from_numpy(px).float() / 255, atol=1e-5)
    with pytest.raises(ConfigError, match="method=heads"):
        visualize(make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={folder}", f"out={tmp_path / 'v2'}",
                                      "device=cpu", "method=heads"], config_name="visualize"))


def test_the_model_cards_naflex_snippet_predicts_like_predict(ckpt, tmp_path, monkeypatch):
    """The usage block of an exported NaFlexVit's README.md, run as a reader would (from the folder that holds
    the export, timm's own NaFlex transform), gives the label and probability of scripts/predict.py per file."""
    import re

    from vitpipe.tasks.export import export
    from vitpipe.tasks.predict import predict

    out = export(export_cfg(tmp_path, ckpt, "timm", tmp_path / "naflex_vit"))
    (code,) = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), flags=re.S)
    assert "naflex=True" in code and "local-dir:naflex_vit" in code
    files = image_folder(tmp_path / "imgs")
    rows = {Path(r["path"]).name: r for r in json.loads(predict(make_cfg(tmp_path, [
        f"ckpt_path={ckpt}", f"images={tmp_path / 'imgs'}", "topk=1", "device=cpu", f"out={tmp_path / 'p.json'}"],
        config_name="predict")).read_text())}
    monkeypatch.chdir(tmp_path)
    probs = []
    for f in files:
        scope: dict = {}
        exec(compile(code.replace('"image.png"', repr(str(f))), "README.md", "exec"), scope)  # our own card
        assert scope["label"] == rows[f.name]["label"]
        probs.append(float(scope["probs"].max()))
        assert abs(probs[-1] - float(rows[f.name]["prob"])) < 1e-5
    assert np.std(probs) > 1e-3  # the files get different answers: the comparison means something

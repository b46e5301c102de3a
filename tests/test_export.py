"""scripts/export.py: timm's hub layout (logits and preprocessing as vitpipe's), ONNX, model card, Hub push."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from PIL import Image

from vitpipe.data.preprocess import Preprocess
from vitpipe.errors import ConfigError, ExportCheckError
from vitpipe.export import export_onnx
from vitpipe.export.check import check_logits
from vitpipe.export.onnx_format import check_onnx
from vitpipe.export.timm_format import check_timm
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.cli import run_cli
from vitpipe.tasks.export import export
from vitpipe.tasks.predict import predict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return lambda kind: tc.checkpoint(kind, base)


def export_cfg(tmp_path: Path, ckpt, fmt: str, out, *overrides: str):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"format={fmt}", f"out={out}", *overrides], config_name="export")


def checkpoint_net(path):
    return rebuild(load_checkpoint(path), path).net


def mixed_size_images(folder: Path, mode: str) -> list[Path]:
    """Six images of mixed sizes and modes (RGB, L, RGBA, palette): random 3x3 blocks, upscaled."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    files = []
    for i, (h, w) in enumerate([(8, 8), (31, 12), (5, 9), (64, 64), (20, 33), (13, 13)]):
        blocks = rng.integers(0, 255, (3, 3, 3), dtype=np.uint8)  # coarse structure: labels vary between images
        im = Image.fromarray(blocks).resize((w, h), Image.Resampling.NEAREST)
        im = [im, im.convert("L"), im.convert("RGBA"), im.convert("P")][i % 4]
        files.append(folder / f"{i}.png")
        im.save(files[-1])
    return files


@pytest.mark.parametrize("kind", ["learned", "learned_nocls", "sincos2d", "sincos2d_nocls"])
def test_timm_local_dir_gives_the_checkpoint_logits(ckpts, tmp_path, kind):
    """timm.create_model("local-dir:DIR", pretrained=True) == the checkpoint's network (<= 1e-5, fp32);
    config.json in timm's layout with vitpipe's preprocessing; a README model card beside it."""
    path = ckpts(kind)
    out = export(export_cfg(tmp_path, path, "timm", tmp_path / "vit"))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # readable by whoever may read the folder
    m = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    net = checkpoint_net(path)
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        diff = (m(x) - net(x)).abs().max().item()
    print(f"timm parity {kind}: max abs diff {diff:.3g}")
    assert diff <= 1e-5
    assert net(x).std() > 0.1  # the logits are far from constant: the comparison means something
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["label_names"] == [str(i) for i in range(10)]
    assert cfg["model_args"]["class_token"] == ("nocls" not in kind)
    pre = cfg["pretrained_cfg"]
    assert (pre["input_size"], pre["crop_mode"], pre["crop_pct"], pre["interpolation"]) == ([1, 8, 8], "squash", 1.0,
                                                                                          "bilinear")
    assert pre["mean"] == [0.3053] and pre["std"] == [0.3759]
    assert "hf_hub_id" not in pre and "tag" not in pre  # nothing of the generic entry point's source weights
    if kind.startswith("sincos"):  # the fixed table is what timm holds, prefix tokens without a position
        assert torch.equal(m.pos_embed.detach(), net.pos_embed.table) and m.no_embed_class
    with torch.no_grad():
        net.head.bias[0] += 1e-4  # the export's own check fails for a network that differs by more than 1e-5
    with pytest.raises(ExportCheckError, match="max abs logit difference"):
        check_timm(net, out, Preprocess(rebuild(load_checkpoint(path), path).datamodule, net).spec)


@pytest.mark.parametrize("kind, mode", [("sincos2d", "L"), ("folder", "RGB")])
def test_timm_transform_predicts_like_predict(ckpts, tmp_path, kind, mode):
    """timm's own transform from the exported config (images converted to the model's mode first) gives the
    labels and probabilities of scripts/predict.py on images of mixed sizes: squash rule (digits) and
    resize + centre crop rule (an image folder, RGB)."""
    path = ckpts(kind)
    files = mixed_size_images(tmp_path / "imgs", mode)
    out = export(export_cfg(tmp_path, path, "timm", tmp_path / "vit"))
    preds = predict(make_cfg(tmp_path, [f"ckpt_path={path}", f"images={tmp_path / 'imgs'}", "topk=1",
                                        f"out={tmp_path / 'p.json'}"], config_name="predict"))
    rows = {Path(r["path"]).name: r for r in json.loads(preds.read_text())}
    m = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    data_cfg = timm.data.resolve_data_config({}, model=m)
    transform = timm.data.create_transform(**data_cfg)
    x = torch.stack([transform(Image.open(f).convert(mode)) for f in files])
    with torch.no_grad():
        probs = m(x).softmax(-1)
    labels = [m.pretrained_cfg["label_names"][i] for i in probs.argmax(-1).tolist()]
    assert labels == [rows[f.name]["label"] for f in files]
    assert probs.max(-1).values.std() > 1e-3  # the images get different answers: the comparison means something
    assert max(abs(float(p) - rows[f.name]["prob"]) for f, p in zip(files, probs.max(-1).values)) < 1e-5


@pytest.mark.parametrize("kind", ["learned", "sincos2d", "rope2d", "conv", "hybrid"])
def test_onnx_matches_pytorch_at_batch_1_and_5(ckpts, tmp_path, kind):
    """One self-contained .onnx file (no .onnx.data), dynamic batch, onnxruntime within 1e-4 of PyTorch."""
    import onnxruntime as ort

    path = ckpts(kind)
    run = rebuild(load_checkpoint(path), path)
    assert getattr(run.net.patch_embed, "depth", 1) == (2 if kind == "hybrid" else 1)  # the stored stem, rebuilt
    out = tmp_path / "m.onnx"
    check = export_onnx(run.net, Preprocess(run.datamodule, run.net).spec, out)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    diffs = []
    for batch in (1, 5):
        x = torch.randn(batch, 1, 8, 8)
        with torch.no_grad():
            diffs.append(np.abs(session.run(None, {"images": x.numpy()})[0] - run.net(x).numpy()).max())
    print(f"onnx parity {kind}: export check {check:.3g}, batch 1 {diffs[0]:.3g}, batch 5 {diffs[1]:.3g}")
    assert max(diffs) <= 1e-4 and check <= 1e-4
    with torch.no_grad():
        run.net.head.bias[0] += 1e-3  # a network that no longer matches the file: the check must say so
    with pytest.raises(ExportCheckError, match="max abs difference"):
        check_onnx(run.net, out, torch.randn(3, 1, 8, 8))


@pytest.mark.parametrize("kind, part", [("rope2d", "rope2d"), ("learned2d", "learned2d"), ("conv", "conv stem"),
                                        ("hybrid", "conv stem")])
def test_timm_refuses_what_it_cannot_express_in_one_line(ckpts, tmp_path, capsys, kind, part):
    out = tmp_path / "vit"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(export, export_cfg(tmp_path, ckpts(kind), "timm", out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(err) == 1 and part in err[0] and "format=onnx" in err[0], err
    assert not out.exists()  # checked before anything is written


def test_hostile_checkpoint_refused_by_export(ckpts, tmp_path):
    marker = tmp_path / "pwned"
    evil = tc.hostile(ckpts("sincos2d").parents[3], marker)
    for fmt, out in (("timm", tmp_path / "vit"), ("onnx", tmp_path / "m.onnx")):
        with pytest.raises(ConfigError, match="builtins.open"):
            export(export_cfg(tmp_path, evil, fmt, out))
    assert not marker.exists()


def test_cli_timm_export_model_card_and_offline_push(tmp_path_factory, tmp_path):
    """The script end to end on a real training run: the folder and its model card (architecture,
    parameter count, data, classes, test metrics, training command, limits) are written, then the Hub
    upload fails offline with one line and status 2."""
    run = tc.trained_run(tmp_path_factory.mktemp("run"))
    out = tmp_path / "digits_vit"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "scripts/export.py", f"ckpt_path={run}", "format=timm", f"out={out}",
                           "push_to_hub=someone/digits-vit", f"hydra.run.dir={tmp_path}/hydra"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) <= 3 and "HF_HUB_OFFLINE" in err[-1] and "someone/digits-vit" in err[-1], err
    card = (out / "README.md").read_text()
    metrics = json.loads((run / "metrics.json").read_text())
    num_params = sum(p.numel() for p in checkpoint_net(run / "checkpoints" / "epoch_000.ckpt").parameters())
    for text in ("library_name: timm", "vit_nano", f"{num_params:,} parameters", "Digits",
                 '[\n "0",\n "1",\n "2",', '"9"\n]\n```', f"test/acc: {metrics['test/acc']:.4f}",
                 "python scripts/train.py debug=fast logger=none", "Intended use and limits", "pos_embed: sincos2d"):
        assert text in card, text
    assert str(tmp_path) not in card and "log_dir" not in card  # no local paths in a card meant for sharing


def test_export_check_names_both_sides_the_measure_and_the_tolerance_and_fails_on_nan():
    """The one check both exporters run: within tolerance it returns the difference; above it, or NaN, one line."""
    net = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        good = net(x)
    assert check_logits(good + 1e-6, net, x, tolerance=1e-5, differs="d") == pytest.approx(1e-6, rel=0.1)
    with pytest.raises(ExportCheckError, match=r"^the copy differs: max abs logit difference 0\.5 > 1e-05; kept$"):
        check_logits(good + 0.5, net, x, tolerance=1e-5, differs="the copy differs", measure="max abs logit difference",
                     then="; kept")
    with pytest.raises(ExportCheckError, match=r"^d: max abs difference nan > 1\.0$"):
        check_logits(torch.full_like(good, float("nan")), net, x, tolerance=1.0, differs="d")

"""scripts/predict.py: image files of any size and mode -> labels the checkpoint's own eval path gives."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.inference.labels import label_names
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.predict import predict

ROOT = Path(__file__).resolve().parents[1]
DIGITS_MEAN, DIGITS_STD = 0.3053, 0.3759


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return lambda kind: tc.checkpoint(kind, base)


def run_predict(tmp_path: Path, ckpt, images, *overrides: str, out: str = "preds.csv") -> Path:
    cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={images}", f"out={tmp_path / out}", "device=cpu",
                              *overrides], config_name="predict")  # cpu: exact comparisons (no TF32 convs)
    return predict(cfg)


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def mixed_folder(folder: Path) -> dict[str, np.ndarray]:
    """Images of five modes and sizes, a corrupt JPEG and a text file; returns each image's 8-bit gray
    content (what the checkpoint's L-mode data sees), computed here without vitpipe."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 255, (23, 17, 3), dtype=np.uint8)
    gray = rng.integers(0, 255, (8, 8), dtype=np.uint8)
    rgba = rng.integers(0, 255, (12, 30, 4), dtype=np.uint8)
    pal = Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).convert("P")
    g16 = rng.integers(0, 256, (16, 9)).astype(np.uint16) * 257  # exactly 8-bit values, stored as 16 bits
    Image.fromarray(rgb).save(folder / "rgb.jpg", quality=95)
    Image.fromarray(gray).save(folder / "gray.png")
    Image.fromarray(rgba, "RGBA").save(folder / "rgba.png")
    pal.save(folder / "palette.png")
    Image.fromarray(g16).save(folder / "deep16.png")
    assert Image.open(folder / "deep16.png").mode == "I;16"
    (folder / "broken.jpg").write_bytes((folder / "rgb.jpg").read_bytes()[:200])  # truncated
    (folder / "notes.txt").write_text("not an image")
    return {
        "rgb.jpg": np.asarray(Image.open(folder / "rgb.jpg").convert("L")),
        "gray.png": gray,
        "rgba.png": np.asarray(Image.fromarray(rgba, "RGBA").convert("L")),
        "palette.png": np.asarray(pal.convert("L")),
        "deep16.png": (g16 // 257).astype(np.uint8),
    }


@torch.no_grad()
def reference_labels(net, contents: dict[str, np.ndarray], in_chans: int) -> dict[str, tuple[int, np.ndarray]]:
    """Label and probabilities of each image by hand: PIL bilinear squash to the 8x8 data size, /255,
    digits statistics, gray repeated to the model's channels; then the network."""
    out = {}
    for name, pixels in contents.items():
        small = np.asarray(Image.fromarray(pixels).resize((8, 8), Image.Resampling.BILINEAR), dtype=np.float32)
        x = torch.from_numpy((small / 255 - DIGITS_MEAN) / DIGITS_STD)[None, None].expand(1, in_chans, 8, 8)
        probs = net(x).softmax(-1)[0]
        out[name] = (int(probs.argmax()), probs.numpy())
    return out


def test_digit_files_reproduce_the_eval_forward_pass(ckpts, tmp_path):
    """Test-split digits written as PNGs at their native size: predict's labels and probabilities are
    those of the network on the data module's own eval tensors (the run's test path)."""
    path = ckpts("sincos2d_rgb")  # gray data, RGB model: the 1 -> 3 channel step is exercised too
    run = rebuild(load_checkpoint(path), path)
    dm = run.datamodule
    dm.setup("test")
    x, y = next(iter(dm.test_dataloader()))  # uint8 (B, 1, 8, 8) on the fast path
    with torch.no_grad():
        probs = run.net(dm.augment_batch(x, train=False)).softmax(-1)
    folder = tmp_path / "digits"
    folder.mkdir()
    for i, img in enumerate(x[:, 0].numpy()):
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    rows = read_csv(run_predict(tmp_path, path, folder, "topk=3", "batch_size=5"))
    assert len(rows) == len(x)
    assert [r["label"] for r in rows] == [run.class_names[i] for i in probs.argmax(-1).tolist()]
    assert len(set(r["label"] for r in rows)) > 1  # random weights: not one answer for everything
    got = torch.tensor([float(r["prob"]) for r in rows])
    assert (got - probs.max(-1).values).abs().max() < 1e-5
    assert list(rows[0]) == ["path", "label", "prob", "top2_label", "top2_prob", "top3_label", "top3_prob"]


def test_mixed_modes_and_sizes_corrupt_file_skipped(ckpts, tmp_path, capsys):
    """RGB JPEG, L, RGBA, palette and 16-bit PNGs of several sizes: one row each, labels as computed by
    hand; the truncated JPEG is named and skipped, the text file ignored, both counted."""
    path = ckpts("sincos2d")
    contents = mixed_folder(tmp_path / "mixed")
    out = run_predict(tmp_path, path, tmp_path / "mixed", "topk=10", out="preds.json")
    rows = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert sorted(Path(r["path"]).name for r in rows) == sorted(contents)
    assert "broken.jpg" in err and "skipped" in err
    run = rebuild(load_checkpoint(path), path)
    ref = reference_labels(run.net, contents, in_chans=1)
    for r in rows:
        label, probs = ref[Path(r["path"]).name]
        assert r["label"] == run.class_names[label], r["path"]
        assert abs(r["prob"] - probs.max()) < 1e-5
        assert [r["label"]] + [r[f"top{k}_label"] for k in range(2, 11)] == \
            [run.class_names[i] for i in np.argsort(-probs, kind="stable")]


def test_cli_folder_glob_tta_and_temperature(ckpts, tmp_path):
    """The script end to end (a subprocess): a glob, tta=hflip, a calibration.json beside the checkpoint
    fitted on it with tta=hflip; the summary counts the skipped file; probabilities are eval's composition:
    the mirror-averaged softmax, its log divided by the temperature, softmax again
    (tests/test_calibration_match.py: the temperature of another checkpoint or TTA is not applied)."""
    from vitpipe.report.calibration import checkpoint_identity, write_calibration

    path = ckpts("learned")
    contents = mixed_folder(tmp_path / "imgs")
    write_calibration(path.parent, 2.5, identity=checkpoint_identity(path, load_checkpoint(path)), tta="hflip")
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "scripts/predict.py", f"ckpt_path={path.parent.parent}",
                               f"images={tmp_path}/imgs/*.*", f"out={tmp_path}/p.csv", "tta=hflip", "topk=2", "device=cpu",
                               f"hydra.run.dir={tmp_path}/hydra"], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        (path.parent / "calibration.json").unlink()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "broken.jpg" in proc.stderr and "1 unreadable file(s) skipped" in proc.stdout
    assert "temperature 2.5" in proc.stdout
    rows = read_csv(tmp_path / "p.csv")
    assert list(rows[0]) == ["path", "label", "prob", "top2_label", "top2_prob"]
    run = rebuild(load_checkpoint(path), path)
    for r in rows:
        pixels = contents[Path(r["path"]).name]
        small = np.asarray(Image.fromarray(pixels).resize((8, 8), Image.Resampling.BILINEAR), dtype=np.float32)
        x = torch.from_numpy((small / 255 - DIGITS_MEAN) / DIGITS_STD)[None, None]
        with torch.no_grad():
            averaged = (run.net(x).softmax(-1) + run.net(x.flip(-1)).softmax(-1)) / 2
            p = (averaged.log() / 2.5).softmax(-1)[0]
        assert r["label"] == run.class_names[int(p.argmax())]
        assert abs(float(r["prob"]) - float(p.max())) < 1e-5


def test_image_folder_checkpoint_uses_its_crop_rule(ckpts, tmp_path):
    """An image-folder checkpoint (varying sizes): predict applies its eval transform (shorter side to
    img_size / 0.875, centre crop) and names classes by folder."""
    from torchvision.transforms import v2

    path = ckpts("folder")
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(3)
    for i, (h, w) in enumerate([(40, 25), (16, 16), (31, 77)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    rows = read_csv(run_predict(tmp_path, path, folder))
    run = rebuild(load_checkpoint(path), path)
    assert run.class_names == ["cat", "dog", "fish"]
    tf = v2.Compose([v2.Resize(18), v2.CenterCrop(16), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    for r in rows:
        with torch.no_grad():
            p = run.net(tf(Image.open(r["path"]).convert("RGB"))[None]).softmax(-1)[0]
        assert r["label"] == run.class_names[int(p.argmax())]
        assert abs(float(r["prob"]) - float(p.max())) < 1e-5


def test_captioner_writes_path_caption(ckpts, tmp_path):
    """A captioning checkpoint: ``path,caption`` rows, the captions its decoder generates (the run's beam
    size) for the images squashed to its input size with ImageNet statistics."""
    path = ckpts("captioner")
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(5)
    for i, size in enumerate([(32, 32), (50, 20), (9, 9)]):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    rows = read_csv(run_predict(tmp_path, path, folder))
    assert list(rows[0]) == ["path", "caption"] and len(rows) == 3
    run = rebuild(load_checkpoint(path), path)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    for r in rows:
        im = Image.open(r["path"]).convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
        x = torch.from_numpy(((np.asarray(im) / 255 - mean) / std).astype(np.float32)).permute(2, 0, 1)[None]
        ids = run.net.generate(x, beam_size=2)
        assert r["caption"] == run.module.tokenizer.batch_decode(ids)[0]
        assert r["caption"].strip()


def test_class_names_fall_back_to_indices_with_a_note(capsys):
    assert label_names(["cat", "dog"], 2) == ["cat", "dog"]
    assert label_names(None, 3) == ["0", "1", "2"]
    assert label_names(["cat"], 2) == ["0", "1"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "no class names" in err[0] and "1 class names for 2 classes" in err[1]


def test_mistakes_are_one_line(ckpts, tmp_path):
    path = ckpts("sincos2d")
    folder = tmp_path / "only_text"
    folder.mkdir()
    (folder / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds no image files"):
        run_predict(tmp_path, path, folder)
    with pytest.raises(ConfigError, match="tta='vflip'"):
        run_predict(tmp_path, path, folder, "tta=vflip")
    with pytest.raises(ConfigError, match=r"\.csv or \.json"):
        run_predict(tmp_path, path, folder, out="preds.txt")
    (folder / "bad.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(ConfigError, match="none of the 1 file"):
        run_predict(tmp_path, path, folder)


def test_hostile_checkpoint_refused_by_predict(ckpts, tmp_path):
    """A stored config naming builtins.open is refused before anything is called: no marker file."""
    marker = tmp_path / "pwned"
    evil = tc.hostile(ckpts("sincos2d").parents[3], marker)
    contents = mixed_folder(tmp_path / "imgs")
    assert contents
    with pytest.raises(ConfigError, match="builtins.open"):
        run_predict(tmp_path, evil, tmp_path / "imgs")
    assert not marker.exists()


def test_tta_hflip_warns_when_the_checkpoint_never_saw_a_flip(ckpts, tmp_path, capsys):
    """Digits train with data.hflip=false: predict tta=hflip says so in one line (and still predicts);
    the same network stored as trained with flips gets no warning."""
    path = ckpts("sincos2d")
    mixed_folder(tmp_path / "imgs")
    run_predict(tmp_path, path, tmp_path / "imgs", "tta=hflip")
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vitpipe: warning:")]
    assert len(lines) == 1 and "tta=hflip" in lines[0] and "data.hflip=false" in lines[0], lines
    flipped = load_checkpoint(path)
    flipped["vitpipe_config"]["data"]["hflip"] = True
    (tmp_path / "flipped").mkdir()
    torch.save(flipped, tmp_path / "flipped" / "f.ckpt")
    run_predict(tmp_path, tmp_path / "flipped" / "f.ckpt", tmp_path / "imgs", "tta=hflip", out="p2.csv")
    run_predict(tmp_path, path, tmp_path / "imgs", out="p3.csv")  # no TTA: nothing to warn about
    assert "vitpipe: warning:" not in capsys.readouterr().err


def _unwritable_dir(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores permission bits: /proc then)."""
    if os.geteuid() == 0:
        return Path("/proc")
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0o500)
    return d


@pytest.mark.parametrize("case", ["file_in_path", "unwritable_dir", "existing_dir", "bad_suffix"])
def test_bad_out_is_refused_before_the_checkpoint_or_any_image_is_read(ckpts, tmp_path, monkeypatch, case):
    """out= that cannot be written is one line naming out= and why, raised before anything loads: the
    checkpoint reader, torch.load and PIL's opener are made to fail the test if predict reaches them."""
    import vitpipe.run.stored

    path = ckpts("sincos2d")
    mixed_folder(tmp_path / "imgs")
    (tmp_path / "somefile.txt").write_text("a file, not a folder")
    (tmp_path / "adir.csv").mkdir()
    out, why = {"file_in_path": (tmp_path / "somefile.txt" / "preds.csv", "is a file, not a folder"),
                "unwritable_dir": (_unwritable_dir(tmp_path) / "sub" / "preds.csv", "cannot create files in"),
                "existing_dir": (tmp_path / "adir.csv", "is a folder"),
                "bad_suffix": (tmp_path / "preds.txt", ".csv or .json")}[case]

    def reached(*args, **kwargs):
        raise AssertionError("predict read the checkpoint or an image before checking out=")

    monkeypatch.setattr(vitpipe.run.stored, "load_checkpoint", reached)
    monkeypatch.setattr(torch, "load", reached)
    monkeypatch.setattr(Image, "open", reached)
    cfg = make_cfg(tmp_path, [f"ckpt_path={path}", f"images={tmp_path / 'imgs'}", f"out={out}", "device=cpu"],
                   config_name="predict")
    with pytest.raises(ConfigError) as err:
        predict(cfg)
    msg = str(err.value)
    assert msg.startswith(f"out={out}") and why in msg and "\n" not in msg, msg


def test_cli_bad_out_exits_2_in_one_line_before_any_prediction(ckpts, tmp_path):
    """The real script: out= under a file exits 2 with one line naming out=; no model was built (the
    checkpoint is unreadable junk, so reading it would have been a different error) and no image read."""
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    mixed_folder(tmp_path / "imgs")
    (tmp_path / "somefile.txt").write_text("x")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/predict.py", f"ckpt_path={junk}", f"images={tmp_path}/imgs",
                           f"out={tmp_path}/somefile.txt/preds.csv", f"hydra.run.dir={tmp_path}/hydra"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"vitpipe: error: out={tmp_path}/somefile.txt/preds.csv: {tmp_path}/somefile.txt is a file, "
                     "not a folder; pass out=<a writable folder>/<name>.csv or .json"], proc.stderr[-2000:]
    assert "vitpipe predict:" not in proc.stdout


def test_output_is_written_through_a_temp_file_and_rename(ckpts, tmp_path, monkeypatch):
    """The CSV appears under its name only whole: the write goes through vitpipe's atomic writer (a
    failure during it leaves the previous file as it was)."""
    import vitpipe.run.files as files_io

    path = ckpts("sincos2d")
    mixed_folder(tmp_path / "imgs")
    out = tmp_path / "preds.csv"
    out.write_text("previous\n")

    def dying_replace(src, dst):
        raise KeyboardInterrupt  # killed between writing the temp file and the rename

    monkeypatch.setattr(files_io.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        run_predict(tmp_path, path, tmp_path / "imgs")
    assert out.read_text() == "previous\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".preds.csv")] == []
    monkeypatch.undo()
    rows = read_csv(run_predict(tmp_path, path, tmp_path / "imgs"))
    assert len(rows) == 5


def test_a_pretraining_checkpoint_is_refused_in_one_line_before_any_image(ckpts, tmp_path):
    """An MAE pre-training checkpoint has no classes: predict, serve and the demo say so in one line
    (predict used to start its loop first; serve failed with an AttributeError)."""
    from vitpipe.errors import ConfigError
    from vitpipe.inference.load import load_predictor

    tc.KINDS.setdefault("mae", ["model=mae_vit_nano", "module=mae"])
    ckpt = ckpts("mae")
    for task in ("predict", "serve", "demo"):
        with pytest.raises(ConfigError, match="holds a MaskedAutoencoderViT, not a classifier") as err:
            load_predictor(ckpt, task_name=task)
        assert "\n" not in str(err.value) and f"; {task} answers those" in str(err.value)
    (tmp_path / "imgs").mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "imgs" / "a.png")
    with pytest.raises(ConfigError, match="MaskedAutoencoderViT"):
        run_predict(tmp_path, ckpt, tmp_path / "imgs")

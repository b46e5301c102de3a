"""What one command accepts the next one reads (vitpipe.run.stored, vitpipe.run.paths), and a file
someone hands us cannot take more memory than it declares (vitpipe.run.safeload).

- A data path training accepts (an absolute ``data.labels`` inside the root, a labels file outside it,
  ``data.splits.*``, a cache folder) is stored by the rule the reader applies: every later command loads it.
- A zip-bomb checkpoint (a small file whose records inflate to hundreds of MB) is refused in one line
  from its zip directory, before ``torch.load`` inflates anything: ``ckpt_path``, ``model.pretrained``,
  a captioner's tokenizer, the recorded-best lookup.
- ``ckpt_path=last`` is the newest run the command can use (train: its own task and model; predict:
  a classifier or captioner; export: a classifier), said in one line, and one line when none fits.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg
from omegaconf import OmegaConf
from PIL import Image
from tiny_checkpoints import checkpoint as tiny_checkpoint
from user_shell import SHORT_TRAIN, fresh_checkout, run, run_dir_of

from vitpipe.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("cat", "dog", "owl")
TINY_VIT = ["model.img_size=16", "model.patch_size=4", "model.dim=32", "model.depth=1", "model.num_heads=2",
            "trainer=cpu", "logger=none"]


def write_multilabel_folder(root: Path) -> Path:
    """root/img/*.png with a labels file root/labels.csv (train/val/test rows) and root/test/*.png to predict."""
    rng = np.random.default_rng(0)
    (root / "img").mkdir(parents=True, exist_ok=True)
    (root / "test").mkdir(exist_ok=True)
    rows = ["path,labels,split"]
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        labels = ";".join(c for j, c in enumerate(CLASSES) if (i >> j) & 1 or j == i % 3)
        rows.append(f"img/{i}.png,{labels},{'train' if i < 16 else 'val' if i < 20 else 'test'}")
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(root / "test" / f"t{i}.png")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


# ---------------------------------------------------------------- item 3: the stored paths


@pytest.mark.slow
def test_absolute_labels_path_inside_the_root_trains_then_predicts_exports_and_evals(tmp_path):
    """docs/multilabel.md: an absolute data.labels path works too. The checkpoint that train writes
    stores it relative to the root (the rule the readers apply), and predict, export and eval load it."""
    data = write_multilabel_folder(tmp_path / "D")
    cwd = fresh_checkout(tmp_path / "w")
    given = f"data=imagefolder data.root={data} data.labels={data}/labels.csv"
    r = run(["python", "scripts/train.py", *given.split(), "module.task=multilabel", *TINY_VIT, *SHORT_TRAIN], cwd)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = run_dir_of(r.stdout)
    ckpt = next((run_dir / "checkpoints").glob("epoch_*.ckpt"))
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["vitpipe_config"]
    assert stored["data"]["labels"] == "labels.csv"  # inside the root: relative to it, as the reader reads it
    assert stored == OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))  # one record, one rule

    p = run(["python", "scripts/predict.py", f"ckpt_path={run_dir}", f"images={data}/test",
             f"out={tmp_path}/preds.csv"], cwd)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(tmp_path / "preds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(Path(row["path"]).name for row in rows) == ["t0.png", "t1.png", "t2.png"]
    assert all(set(filter(None, row["labels"].split(";"))) <= set(CLASSES) for row in rows)

    e = run(["python", "scripts/export.py", f"ckpt_path={run_dir}", f"out={tmp_path}/timm"], cwd)
    assert e.returncode == 0, e.stderr[-2000:]
    assert json.loads((tmp_path / "timm" / "config.json").read_text())["num_classes"] == len(CLASSES)

    v = run(["python", "scripts/eval.py", f"ckpt_path={run_dir}", *given.split(), "trainer.accelerator=cpu"], cwd)
    assert v.returncode == 0, v.stderr[-2000:]
    assert "refused" not in p.stderr + e.stderr + v.stderr


def _multilabel_checkpoint(tmp_path: Path, labels: str) -> Path:
    """A multi-label checkpoint (random weights) whose stored config names ``data.labels=labels``,
    as training with that value stored it before the rule (an absolute path kept as given)."""
    from vitpipe.run.build import build_from_config

    data = write_multilabel_folder(tmp_path / "D")
    cfg = make_cfg(tmp_path, ["debug=fast", "data=imagefolder", f"data.root={data}", "data.labels=labels.csv",
                              "module.task=multilabel", *TINY_VIT])
    dm, _, module = build_from_config(cfg)
    stored = OmegaConf.to_container(cfg, resolve=True)
    stored.pop("hydra", None)
    stored["data"]["labels"] = labels
    path = tmp_path / "run" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": module.state_dict(), "vitpipe_config": stored, "class_names": list(dm.class_names)},
               path)
    return path


@pytest.mark.parametrize("where", ["absolute-inside", "dotdot-inside", "outside"])
def test_every_labels_path_training_accepts_loads_for_predict(tmp_path, where):
    """A checkpoint whose stored data.labels is absolute inside the root, `a/../labels.csv`, or a file
    outside the root (training reads any of them) rebuilds for predict (serve and demo load through the
    same load_predictor); the path read back never points outside the current data root."""
    from vitpipe.inference.load import load_predictor
    from vitpipe.run.paths import default_paths

    outside = tmp_path / "elsewhere" / "labels.csv"
    value = {"absolute-inside": str(tmp_path / "D" / "labels.csv"), "dotdot-inside": "img/../labels.csv",
             "outside": str(outside)}[where]
    ckpt = _multilabel_checkpoint(tmp_path, value)
    if where == "outside":
        outside.parent.mkdir()
        shutil.move(tmp_path / "D" / "labels.csv", outside)
    paths = default_paths()
    paths.data_dir = str(tmp_path / "data")
    loaded = load_predictor(str(ckpt), paths=paths)
    assert loaded.kind.name == "multilabel" and loaded.net.num_classes == len(CLASSES)
    assert loaded.built.cfg.data.labels == "labels.csv"  # relative: read under the current root, nowhere else


@pytest.mark.parametrize("section, expect", [
    ({"root": "/d/coco", "splits": {"train": {"captions": "/d/coco/ann/train.json", "images": "/d/coco/train2017"},
                                    "val": {"captions": "ann/val.json", "images": "/mnt/other/val2017"}}},
     {"splits": {"train": {"captions": "ann/train.json", "images": "train2017"},
                 "val": {"captions": "ann/val.json", "images": "val2017"}}}),
    ({"root": "/d/coco", "splits": {"train": {"captions": "../x.json", "images": "train2017"}},
      "karpathy_split": "/d/coco/dataset_coco.json"},
     {"splits": {"train": {"captions": "x.json", "images": "train2017"}}, "karpathy_split": "dataset_coco.json"}),
    ({"root": "s3://bucket/shards", "cache_dir": "/scratch/cache", "storage_options": {"verify": "/etc/ca.pem"}},
     {"cache_dir": None, "storage_options": None}),
], ids=["coco-splits", "coco-escaping-split-and-karpathy", "shards-cache-dir"])
def test_other_stored_data_paths_are_read_under_the_current_root(tmp_path, section, expect):
    """data.splits.* (inside the root: relative; outside: the name under the current root), a Karpathy
    split file, a shards cache folder and storage options (this machine's, never the file's): what the
    reader rebuilds from a stored data section training accepted, and no refusal."""
    from vitpipe.run.stored import stored_data

    data = {"_target_": "vitpipe.data.captions.COCOCaptionDataModule", **section}
    got = stored_data(data, {"data_dir": "/old/data"}, str(tmp_path / "data"))
    assert got["root"] == str(tmp_path / "data")  # data roots are never taken from a checkpoint
    for key, value in expect.items():
        assert got[key] == value, key


# ---------------------------------------------------------------- item 5: the zip bomb


def make_bomb(path: Path, declared: int) -> Path:
    """A torch.save archive whose one storage record is ``declared`` zero bytes, deflated: ~1/230 of that on disk."""
    import io

    buf = io.BytesIO()
    torch.save({"state_dict": {"net.w": torch.zeros(4)}, "vitpipe_config": {}, "tokenizer": {}}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            if not info.filename.endswith("/data/0"):
                out.writestr(info, src.read(info.filename))
                continue
            record = zipfile.ZipInfo(info.filename)
            record.compress_type, record._compresslevel = zipfile.ZIP_DEFLATED, 1
            with out.open(record, "w", force_zip64=True) as f:
                for start in range(0, declared, len(chunk)):
                    f.write(chunk[: min(len(chunk), declared - start)])
    return path


BOMB_MB = 300
LOADERS = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from vitpipe.errors import ConfigError
    from vitpipe.models.weights import read_state_dict
    from vitpipe.run.checkpoint import load_from_checkpoint
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.run.paths import resolve_ckpt_path
    bomb, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    said = {}
    for name, call in [("ckpt_path", lambda: load_checkpoint(bomb)), ("model.pretrained", lambda: read_state_dict(bomb)),
                       ("tokenizer", lambda: load_from_checkpoint(bomb)), ("recorded best", lambda: resolve_ckpt_path(run_dir))]:
        try:
            call()
            said[name] = "loaded"
        except ConfigError as e:
            said[name] = str(e)
        except Exception as e:
            said[name] = "raised " + type(e).__name__
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB on Linux
    print(json.dumps({"grew_mb": grew, "said": said}))
""")


def _bomb_run(tmp_path: Path, declared_mb: int) -> tuple[Path, Path]:
    """(the bomb, a run directory whose checkpoints, last.ckpt included (read for the recorded best), are the bomb)."""
    bomb = make_bomb(tmp_path / "bomb.ckpt", declared_mb << 20)
    assert bomb.stat().st_size < (declared_mb << 20) / 100
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("epoch_000.ckpt", "epoch_001.ckpt", "last.ckpt"):
        shutil.copy(bomb, folder / name)
    return bomb, folder.parent


def test_zip_bomb_is_refused_in_one_line_before_torch_load_runs(tmp_path, monkeypatch):
    """A small archive declaring 32 MB: each loader of a handed torch file (ckpt_path, model.pretrained, a
    captioner's tokenizer (read by load_from_checkpoint), the recorded-best lookup of a run directory) refuses
    it in one line from the zip's directory; torch.load, which allocates and inflates each record first, is
    never called on it."""
    from vitpipe.models.weights import read_state_dict
    from vitpipe.run.checkpoint import load_from_checkpoint
    from vitpipe.run.paths import resolve_ckpt_path
    from vitpipe.run.stored import load_checkpoint

    bomb, run_dir = _bomb_run(tmp_path, 32)
    opened = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: opened.append(Path(f)) or real_load(f, *a, **k))
    for name, call in [("ckpt_path", lambda: load_checkpoint(bomb)), ("model.pretrained", lambda: read_state_dict(bomb)),
                       ("tokenizer", lambda: load_from_checkpoint(bomb)), ("recorded best", lambda: resolve_ckpt_path(run_dir))]:
        with pytest.raises(ConfigError) as e:
            call()
        assert "declare" in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert opened == []


@pytest.mark.slow
def test_zip_bomb_peak_memory_stays_far_below_what_it_declares(tmp_path):
    """A ~1.3 MB archive declaring 300 MB, read by every loader in a fresh process: its peak memory grows by
    far less than what the records declare (before: torch.load inflated the record, +300 MB or more)."""
    bomb, run_dir = _bomb_run(tmp_path, BOMB_MB)
    r = subprocess.run([sys.executable, "-c", LOADERS, str(bomb), str(run_dir)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["grew_mb"] < BOMB_MB / 4, out  # before: +300 MB or more, the record inflated in memory
    for name, message in out["said"].items():
        assert "declare" in message and "\n" not in message, (name, message)
    assert "refused checkpoint" in out["said"]["ckpt_path"] and "nothing was loaded" in out["said"]["ckpt_path"]


def test_real_checkpoints_are_within_the_bound(tmp_path):
    """The bound refuses nothing torch.save writes: a tiny checkpoint (headers dominate) and a larger one."""
    from vitpipe.run.safeload import check_archive

    small = tiny_checkpoint("learned", tmp_path)
    big = tmp_path / "big.ckpt"
    torch.save({"state_dict": {"net.w": torch.zeros(4 << 20)}}, big)  # 16 MB of zeros, stored as they are
    for path in (small, big):
        check_archive(path)


@pytest.mark.slow
def test_zip_bomb_on_the_command_line_is_one_line_at_small_memory(tmp_path):
    """``predict.py ckpt_path=<bomb>`` and ``train.py model.pretrained=<bomb>`` as typed: exit 2, one line, and
    the peak memory of the command no higher than for a text file named as the checkpoint."""
    bomb = make_bomb(tmp_path / "bomb.ckpt", 600 << 20)
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    images = tmp_path / "images"  # predict checks its images before it reads the checkpoint
    images.mkdir()
    Image.fromarray(np.full((8, 8), 128, dtype=np.uint8)).save(images / "a.png")
    cwd = fresh_checkout(tmp_path / "w")
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('maxrss', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")

    def peak(*command: str) -> tuple[int, int, str]:
        r = run(["python", "-c", measure, sys.executable, *command], cwd)
        _, kib, rc = r.stdout.strip().splitlines()[-1].split()
        return int(kib) >> 10, int(rc), r.stderr

    base_mb, rc, err = peak("scripts/predict.py", f"ckpt_path={text}", f"images={images}")
    assert rc == 2 and "cannot read checkpoint" in err, err[-2000:]  # the baseline: read, refused, no inflation
    for command in (["scripts/predict.py", f"ckpt_path={bomb}", f"images={images}"],
                    ["scripts/train.py", "debug=fast", "logger=none", f"model.pretrained={bomb}"]):
        mb, rc, err = peak(*command)
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("vitpipe: error:")]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert "declare" in lines[0] and str(bomb) in lines[0], lines[0]
        assert mb < base_mb + 150, (command, mb, base_mb)  # before: + the 600 MB the record inflates to


# ---------------------------------------------------------------- item 15: ckpt_path=last


def _fake_run(log_dir: Path, name: str, ckpt: dict, mtime: float) -> Path:
    """<log_dir>/runs/<name>/ with config.yaml (its stored config) and checkpoints/last.ckpt of ``ckpt``."""
    run_dir = log_dir / "runs" / name
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(ckpt["vitpipe_config"])))
    torch.save(ckpt, run_dir / "checkpoints" / "last.ckpt")
    os.utime(run_dir / "checkpoints" / "last.ckpt", (mtime, mtime))
    return run_dir


def _mae_checkpoint() -> dict:
    config = {"task_name": "train", "model": {"_target_": "vitpipe.models.registry.create_mae", "name": "mae_vit_nano"},
              "module": {"_target_": "vitpipe.lit.mae.MAEModule"}}
    return {"state_dict": {"net.mask_token": torch.zeros(1, 1, 32)}, "vitpipe_config": config}


def test_train_ckpt_path_last_resumes_the_newest_run_of_its_own_task_and_model(tmp_path, capsys):
    """The README order: a classifier run, then MAE pre-training, then ``train.py ckpt_path=last``:
    the classifier run (the MAE one was newer), named in one line with what was passed over; a newer
    classifier of another width is passed over too (its weights do not fit)."""
    from vitpipe.run.build import build_from_config
    from vitpipe.tasks.train import resume_path

    cfg = make_cfg(tmp_path, ["debug=fast", "logger=none", "ckpt_path=last"])
    _, net, _ = build_from_config(cfg)
    log_dir = Path(cfg.paths.log_dir) / cfg.task_name
    own = torch.load(tiny_checkpoint("sincos2d", tmp_path / "tiny"), map_location="cpu", weights_only=True)
    wider = torch.load(tiny_checkpoint("sincos2d_rgb", tmp_path / "tiny"), map_location="cpu", weights_only=True)
    classifier = _fake_run(log_dir, "2026-01-01_00-00-00", own, 1_000_000)
    _fake_run(log_dir, "2026-01-02_00-00-00", wider, 2_000_000)
    mae = _fake_run(log_dir, "2026-01-03_00-00-00", _mae_checkpoint(), 3_000_000)
    capsys.readouterr()
    assert resume_path(cfg, net) == str(classifier / "checkpoints" / "last.ckpt")
    said = [ln for ln in capsys.readouterr().out.splitlines() if "ckpt_path=last" in ln]
    assert len(said) == 1 and str(classifier) in said[0] and "(classifier)" in said[0], said
    assert "passed over 2 newer run(s)" in said[0] and str(mae) in said[0] and "MAE pre-training" in said[0], said


def test_predict_ckpt_path_last_takes_a_classifier_and_none_fitting_is_one_line(tmp_path, capsys):
    """predict (serve, demo: the same load_predictor) and export after an MAE pre-training run: the newest
    classifier run; with only MAE runs under logs/, one line naming the newest and what would fit."""
    from vitpipe.run.paths import needs_kinds, resolve_ckpt_path

    log_dir = tmp_path / "logs"
    own = torch.load(tiny_checkpoint("sincos2d", tmp_path / "tiny"), map_location="cpu", weights_only=True)
    only_mae = _fake_run(tmp_path / "mae_only" / "train", "2026-01-03_00-00-00", _mae_checkpoint(), 3_000_000)
    with pytest.raises(ConfigError) as e:
        resolve_ckpt_path("last", log_dir=tmp_path / "mae_only", usable=needs_kinds("classifier", command="export"))
    message = str(e.value)
    assert "\n" not in message and str(only_mae) in message and "is an MAE pre-training run" in message, message
    assert "export takes classifier runs" in message, message

    classifier = _fake_run(log_dir / "myexp", "2026-01-01_00-00-00", own, 1_000_000)
    _fake_run(log_dir / "train", "2026-01-03_00-00-00", _mae_checkpoint(), 3_000_000)
    capsys.readouterr()
    for usable in (needs_kinds("classifier", "captioner", command="predict"), needs_kinds("classifier", command="export")):
        got = resolve_ckpt_path("last", log_dir=log_dir, usable=usable)
        assert got == classifier / "checkpoints" / "last.ckpt"
    said = [ln for ln in capsys.readouterr().out.splitlines() if "ckpt_path=last" in ln]
    assert len(said) == 2 and all(str(classifier) in ln and "passed over 1 newer run(s)" in ln for ln in said), said


@pytest.mark.slow
def test_readme_order_train_mae_then_ckpt_path_last_resumes_and_predicts_the_classifier(tmp_path):
    """As typed in the README's order: the default run, the MAE pre-training line, then
    ``train.py ckpt_path=last`` resumes the default run (it chose the MAE run: "does not fit the configured
    model") and ``predict.py ckpt_path=last`` answers with it (it refused the MAE run)."""
    cwd = fresh_checkout(tmp_path / "w")
    first = run(["python", "scripts/train.py", *SHORT_TRAIN], cwd)
    assert first.returncode == 0, first.stderr[-2000:]
    classifier = run_dir_of(first.stdout)
    mae = run(["python", "scripts/train.py", "model=mae_vit_nano", "module=mae", *SHORT_TRAIN], cwd)
    assert mae.returncode == 0, mae.stderr[-2000:]
    resumed = run(["python", "scripts/train.py", "ckpt_path=last", *SHORT_TRAIN], cwd)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = [ln for ln in resumed.stdout.splitlines() if ln.startswith("vitpipe: ckpt_path=last -> run")]
    assert len(said) == 1 and f"run {classifier} (classifier)" in said[0] and str(run_dir_of(mae.stdout)) in said[0]
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.full((8, 8), 128, dtype=np.uint8)).save(images / "a.png")
    p = run(["python", "scripts/predict.py", "ckpt_path=last", f"images={images}", f"out={tmp_path}/p.csv"], cwd)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"run {classifier} (classifier)" in p.stdout

"""A temperature from calibration.json is used only with the checkpoint and the TTA it was fitted on, and
eval and predict turn logits into probabilities the same way: logits -> TTA -> temperature -> softmax.

One tiny trained run (tests/tiny_checkpoints.py) is calibrated by ``scripts/eval.py calibrate=true
tta=hflip`` on its best checkpoint; predict then meets that calibration.json with the same checkpoint
(applied), with last.ckpt of the same run (not applied), with tta=none (not applied), in a copy of the
run directory (applied) and after the checkpoint file is replaced by a later save (not applied).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from PIL import Image
from sklearn.datasets import load_digits

from vitpipe.data.images import open_image
from vitpipe.data.preprocess import Preprocess
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint


def test_eval_and_predict_compose_tta_then_temperature_identically():
    """softmax(log(mean of the two views' softmax) / T): the temperature eval fits on TTA-averaged
    validation logits is applied to TTA-averaged logits in predict too."""
    from vitpipe import create_model
    from vitpipe.inference.probs import class_probs
    from vitpipe.inference.tta import at_test_time

    torch.manual_seed(0)
    net = create_model("vit_micro", num_classes=5, depth=1, img_size=16, patch_size=4).eval()
    x = torch.randn(4, 3, 16, 16)
    t = 2.5
    with torch.no_grad():
        net.head.weight.mul_(40)  # confident logits (several units apart): the two orders differ clearly
        logits, mirrored = net(x), net(x.flip(-1))
        by_hand = (((logits.softmax(-1) + mirrored.softmax(-1)) / 2).log() / t).softmax(-1)
        other_order = ((logits / t).softmax(-1) + (mirrored / t).softmax(-1)) / 2
        assert (by_hand - other_order).abs().max() > 1e-2
        with at_test_time(net, tta="hflip", temperature=t):
            in_eval = net(x).softmax(-1)
        in_predict = class_probs(net, x, tta="hflip", temperature=t)
    torch.testing.assert_close(in_eval, by_hand)
    torch.testing.assert_close(in_predict, by_hand)


# ---- calibration.json meets checkpoints and TTA settings -----------------------------------------


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A copy of the tiny trained run, its best checkpoint calibrated with tta=hflip; digit PNGs."""
    from vitpipe.tasks.evaluate import evaluate

    base = tmp_path_factory.mktemp("calibrated")
    run = base / "run"
    shutil.copytree(tc.trained_run(tmp_path_factory.mktemp("trained")), run)
    best = run / "checkpoints" / "epoch_000.ckpt"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    cfg = make_cfg(base / "eval", [f"ckpt_path={best}", "calibrate=true", "tta=hflip", "trainer.accelerator=cpu",
                                   "trainer.precision=32-true", "+trainer.enable_progress_bar=false"],
                   config_name="eval")
    metrics = evaluate(cfg)
    images = base / "digits"
    images.mkdir()
    d = load_digits()
    for i in range(12):
        Image.fromarray((d.images[-1 - i] * 255 / 16).astype(np.uint8)).save(images / f"{i:02d}.png")
    return run, best, images, metrics["test/temperature"]


def _predict(tmp_path: Path, ckpt: Path, images: Path, *overrides: str) -> list[dict]:
    from vitpipe.tasks.predict import predict

    cfg = make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"images={images}", f"out={tmp_path / 'p.csv'}", "device=cpu",
                              "topk=10", *overrides], config_name="predict")
    with predict(cfg).open() as f:
        return list(csv.DictReader(f))


@torch.no_grad()
def _expected(ckpt: Path, images: Path, *, tta: str, temperature: float | None) -> dict[str, np.ndarray]:
    """Probabilities per file name, by hand from the network: mirror average, then / T, then softmax."""
    run = rebuild(load_checkpoint(ckpt), ckpt)
    pre = Preprocess(run.datamodule, run.net)
    out = {}
    for f in sorted(images.iterdir()):
        x = pre(open_image(f, pre.spec.mode))[None]
        p = run.net(x).softmax(-1)
        if tta == "hflip":
            p = (p + run.net(x.flip(-1)).softmax(-1)) / 2
        out[f.name] = (p.log() / (temperature or 1.0)).softmax(-1)[0].numpy()
    return out


def _check(rows: list[dict], expected: dict[str, np.ndarray]) -> None:
    assert len(rows) == len(expected)
    for r in rows:
        p = expected[Path(r["path"]).name]
        assert abs(float(r["prob"]) - p.max()) < 1e-5, r
        assert abs(float(r["top2_prob"]) - np.sort(p)[-2]) < 1e-5, r


def _notes(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "calibration.json" in line]


def test_calibration_records_the_checkpoint_and_tta(calibrated):
    run, best, _, t = calibrated
    cal = json.loads((best.parent / "calibration.json").read_text())
    assert cal["temperature"] == pytest.approx(t) and abs(np.log(t)) > 0.05  # far enough from 1 to tell apart
    assert cal["tta"] == "hflip" and cal["checkpoint"] == "checkpoints/epoch_000.ckpt"
    assert cal["checkpoint_bytes"] == best.stat().st_size
    assert cal["global_step"] == load_checkpoint(best)["global_step"]
    assert str(run) not in json.dumps(cal)  # nothing that a copy of the run directory would contradict


def test_same_checkpoint_and_tta_apply_the_temperature(calibrated, tmp_path, capsys):
    run, best, images, t = calibrated
    rows = _predict(tmp_path, best, images, "tta=hflip")
    assert _notes(capsys) == []  # nothing to warn about
    _check(rows, _expected(best, images, tta="hflip", temperature=t))
    # ckpt_path=<run dir> resolves to the same best checkpoint
    _check(_predict(tmp_path / "dir", run, images, "tta=hflip"), _expected(best, images, tta="hflip", temperature=t))


def test_other_checkpoint_of_the_run_does_not_get_the_temperature(calibrated, tmp_path, capsys):
    """last.ckpt sits beside the calibrated epoch_000.ckpt (the same step here, even): not applied, one line."""
    run, best, images, _ = calibrated
    last = best.parent / "last.ckpt"
    rows = _predict(tmp_path, last, images, "tta=hflip")
    _check(rows, _expected(last, images, tta="hflip", temperature=None))
    notes = _notes(capsys)
    assert len(notes) == 1 and "not applied" in notes[0] and "epoch_000.ckpt" in notes[0] \
        and "last.ckpt" in notes[0], notes


def test_other_tta_does_not_get_the_temperature(calibrated, tmp_path, capsys):
    run, best, images, _ = calibrated
    rows = _predict(tmp_path, best, images, "tta=none")
    _check(rows, _expected(best, images, tta="none", temperature=None))
    notes = _notes(capsys)
    assert len(notes) == 1 and "not applied" in notes[0] and "tta=hflip" in notes[0] and "tta=none" in notes[0], notes


def test_copied_run_keeps_its_calibration_and_a_resaved_checkpoint_loses_it(calibrated, tmp_path, capsys):
    run, best, images, t = calibrated
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(run, copy)  # new paths, new mtimes: the identity is the name, size and step
    ckpt = copy / "checkpoints" / "epoch_000.ckpt"
    _check(_predict(tmp_path / "a", ckpt, images, "tta=hflip"), _expected(ckpt, images, tta="hflip", temperature=t))
    assert _notes(capsys) == []
    later = load_checkpoint(ckpt)  # the same file name saved again later in training: other weights
    later["global_step"] += 1
    with torch.no_grad():
        later["state_dict"]["net.head.bias"] += 0.5
    torch.save(later, ckpt)
    rows = _predict(tmp_path / "b", ckpt, images, "tta=hflip")
    _check(rows, _expected(ckpt, images, tta="hflip", temperature=None))
    notes = _notes(capsys)
    assert len(notes) == 1 and "not applied" in notes[0] and "step" in notes[0], notes


def test_calibration_json_without_a_checkpoint_record_is_not_applied(calibrated, tmp_path, capsys):
    """A hand-written or older file ({"temperature": T} only) cannot be matched: not applied, one line."""
    run, best, images, _ = calibrated
    folder = tmp_path / "lone"
    folder.mkdir()
    shutil.copy(best, folder / "model.ckpt")
    (folder / "calibration.json").write_text(json.dumps({"temperature": 2.5}))
    rows = _predict(tmp_path, folder / "model.ckpt", images)
    _check(rows, _expected(folder / "model.ckpt", images, tta="none", temperature=None))
    notes = _notes(capsys)
    assert len(notes) == 1 and "not applied" in notes[0] and "calibrate=true" in notes[0], notes

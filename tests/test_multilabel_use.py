"""Using a multi-label checkpoint: eval's predictions.csv recomputes its metrics with sklearn, predict's
label sets are the scores at the thresholds, tuned thresholds (thresholds.json) are what predict and serve
apply, the endpoint answers predict's row, and the multiclass-only options are refused in one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, f1_score

from conftest import make_cfg
from vitpipe.errors import ConfigError
from vitpipe.report.multilabel import read_multilabel_predictions
from vitpipe.tasks.make_mosaics import MosaicConfig, make_mosaics

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
THRESHOLD = 0.3  # the run's module.threshold: a 3-epoch net scores below 0.5 everywhere, F1 needs some positives


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny multi-label run on 240 / 64 / 64 mosaics (a 1-block ViT, 3 epochs): its run dir and data root."""
    from vitpipe.tasks.train import train

    base = tmp_path_factory.mktemp("ml_use")
    root = make_mosaics(MosaicConfig(out=str(base / "mosaics"), train=240, val=64, test=64, seed=0), progress=False)
    cfg = make_cfg(base / "train", [
        "debug=fast", "data=imagefolder", f"data.root={root}", "data.labels=labels.csv", "module.task=multilabel",
        "model=vit_nano", "model.img_size=56", "model.patch_size=14", "model.dim=32", "model.depth=1",
        "model.num_heads=2", "trainer=cpu", "trainer.precision=32-true", "logger=none", "data.num_workers=0",
        "data.batch_size=32", "data.eval_batch_size=32", "data.augment=false", "module.optimizer.lr=3e-3",
        "module.label_smoothing=0", f"module.threshold={THRESHOLD}", "trainer.max_epochs=3", "trainer.limit_train_batches=null",
        "trainer.limit_val_batches=null", "trainer.limit_test_batches=null"])
    train(cfg)
    run = Path(cfg.paths.output_dir)
    ckpt = next((run / "checkpoints").glob("epoch_*.ckpt"))
    return {"run": run, "ckpt": ckpt, "root": Path(root), "base": base}


def evaluate(trained, sub: str, *overrides):
    from vitpipe.tasks.evaluate import evaluate as run_eval

    cfg = make_cfg(trained["base"] / sub, [f"ckpt_path={trained['ckpt']}", "data=imagefolder",
                                          f"data.root={trained['root']}", "data.labels=labels.csv",
                                          "data.augment=false", "data.eval_batch_size=32", "trainer.accelerator=cpu",
                                          "trainer.precision=32-true", "+trainer.enable_progress_bar=false",
                                          *overrides], config_name="eval")
    return run_eval(cfg), Path(cfg.paths.output_dir)


def predict_rows(trained, sub: str, *overrides, out="preds.csv") -> list[dict]:
    from vitpipe.tasks.predict import predict

    base = trained["base"] / sub
    cfg = make_cfg(base, [f"ckpt_path={trained['ckpt']}", f"images={trained['root'] / 'test'}", f"out={base / out}",
                          "device=cpu", *overrides], config_name="predict")
    path = predict(cfg)
    if path.suffix == ".json":
        return json.loads(path.read_text())
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def class_names(trained) -> list[str]:
    return list(torch.load(trained["ckpt"], map_location="cpu", weights_only=True)["class_names"])


def scores_of(row: dict, names: list[str]) -> np.ndarray:
    return np.array([float(row[f"score:{n}"]) for n in names])


# ---- eval ---------------------------------------------------------------------------------------


def test_eval_predictions_csv_recomputes_the_reported_map_ap_and_f1_with_sklearn(trained):
    metrics, out = evaluate(trained, "eval")
    names, scores, target = read_multilabel_predictions(out / "predictions.csv")
    assert names == class_names(trained) and scores.shape == target.shape == (64, len(names))
    assert target.sum(1).min() >= 1 and target.sum(1).max() <= 4
    assert metrics["test/map"] == pytest.approx(average_precision_score(target, scores, average="macro"), abs=1e-6)
    assert metrics["test/map_micro"] == pytest.approx(average_precision_score(target, scores, average="micro"), abs=1e-6)
    ap = average_precision_score(target, scores, average=None)
    pred = (scores >= THRESHOLD).astype(int)
    f1 = f1_score(target, pred, average=None, zero_division=0)
    for c, name in enumerate(names):
        assert metrics[f"test/ap/{name}"] == pytest.approx(ap[c], abs=1e-6), name
    for avg in ("macro", "micro"):
        assert metrics[f"test/f1_{avg}"] == pytest.approx(f1_score(target, pred, average=avg, zero_division=0), abs=1e-6)
    assert metrics["test/f1_macro"] == pytest.approx(f1.mean(), abs=1e-6)
    assert metrics["test/f1_example"] == pytest.approx(f1_score(target, pred, average="samples", zero_division=0), abs=1e-6)
    assert np.unique(pred).size == 2  # some labels predicted, some not: F1 is exercised
    # the report's per-class table is the same file's numbers
    with (out / "report" / "per_class.csv").open() as f:
        table = {r["class"]: r for r in csv.DictReader(f)}
    for c, name in enumerate(names):
        assert float(table[name]["ap"]) == pytest.approx(ap[c], abs=1e-5)
        assert float(table[name]["f1"]) == pytest.approx(f1[c], abs=1e-5)
    assert "Per-class AP" in (out / "report" / "report.md").read_text()


@pytest.mark.parametrize("overrides, words", [
    (["calibrate=true"], "calibrate=true fits a softmax temperature"),
    (["tta=hflip"], "tta=hflip averages softmax"),
    (["split=test", "tune_thresholds=true"], "use split=val"),
])
def test_eval_refuses_multiclass_only_options_in_one_line(trained, overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        evaluate(trained, "refused", *overrides)
    assert "\n" not in str(err.value)

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
from conftest import make_cfg
from sklearn.metrics import average_precision_score, f1_score

from vitpipe.errors import ConfigError
from vitpipe.kinds.registry import KINDS
from vitpipe.report.predictions import read_multilabel_predictions
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


# ---- predict ------------------------------------------------------------------------------------


def eval_scores(trained) -> dict[str, np.ndarray]:
    """Scores per test image file, from eval's predictions.csv (module cache)."""
    if "eval_scores" not in trained:
        _, out = evaluate(trained, "eval_scores")
        names = class_names(trained)
        with (out / "predictions.csv").open(newline="") as f:
            trained["eval_scores"] = {Path(r["path"]).name: scores_of(r, names) for r in csv.DictReader(f)}
    return trained["eval_scores"]


def all_scores(row: dict, names: list[str]) -> np.ndarray:
    """Every class's score from a row written with topk >= the class count."""
    top = {row[f"top{r}_label"]: float(row[f"top{r}_prob"]) for r in range(1, len(names) + 1)}
    return np.array([top[n] for n in names])


@pytest.mark.parametrize("threshold", [0.5, THRESHOLD])
def test_predict_labels_are_exactly_the_classes_at_or_above_the_threshold(trained, threshold):
    names = class_names(trained)
    rows = predict_rows(trained, f"predict_{threshold}", f"threshold={threshold}", f"topk={len(names)}")
    reference = eval_scores(trained)
    assert len(rows) == 64 and set(rows[0]) >= {"path", "labels", "probs", "top1_label", "top1_prob"}
    chosen = 0
    for row in rows:
        scores = all_scores(row, names)
        # predict's scores are eval's (same transform, same sigmoid), to the 6 digits the CSV keeps
        np.testing.assert_allclose(scores, reference[Path(row["path"]).name], rtol=1e-5, atol=1e-6)
        labels = row["labels"].split(";") if row["labels"] else []
        probs = [float(p) for p in row["probs"].split(";")] if row["probs"] else []
        expected = [n for n, s in sorted(zip(names, scores), key=lambda t: -t[1]) if s >= threshold]
        assert labels == expected and probs == pytest.approx(sorted(scores[scores >= threshold])[::-1], abs=1e-6)
        chosen += len(labels)
    if threshold == THRESHOLD:
        assert 0 < chosen < 64 * len(names)  # some labels chosen, not all: the comparison has content


def test_predict_json_rows_carry_label_lists(trained):
    rows = predict_rows(trained, "predict_json", f"threshold={THRESHOLD}", "topk=3", out="preds.json")
    assert isinstance(rows[0]["labels"], list) and isinstance(rows[0]["probs"], list)
    assert all(p >= THRESHOLD for r in rows for p in r["probs"]) and "top4_label" not in rows[0]


@pytest.mark.parametrize("overrides, words", [(["tta=hflip"], "averages softmax"), (["threshold=1.5"], "threshold=1.5")])
def test_predict_refuses_in_one_line(trained, overrides, words):
    with pytest.raises(ConfigError, match=words) as err:
        predict_rows(trained, "predict_refused", *overrides)
    assert "\n" not in str(err.value)


# ---- thresholds tuned on validation --------------------------------------------------------------


def test_tuned_thresholds_maximise_val_f1_and_are_what_predict_applies(trained, capfd):
    metrics, out = evaluate(trained, "tune", "split=val", "tune_thresholds=true")
    record = json.loads((trained["ckpt"].parent / "thresholds.json").read_text())
    names = class_names(trained)
    assert record["checkpoint"] == f"checkpoints/{trained['ckpt'].name}" and record["fitted_on"] == "val"
    _, scores, target = read_multilabel_predictions(out / "predictions.csv")  # the validation split
    t = np.array([record["thresholds"][n] for n in names])
    for c, n in enumerate(names):
        f1 = f1_score(target[:, c], scores[:, c] >= t[c], zero_division=0)
        assert f1 == pytest.approx(record["f1"][n], abs=1e-9), n
        best = max(f1_score(target[:, c], scores[:, c] >= s, zero_division=0) for s in scores[:, c])
        assert f1 == pytest.approx(best, abs=1e-9), n  # no candidate threshold does better on val
    assert metrics["val/f1_macro_tuned"] == pytest.approx(np.mean(list(record["f1"].values())), abs=1e-6)
    assert metrics["val/f1_macro_tuned"] >= metrics["val/f1_macro"] - 1e-6
    capfd.readouterr()
    # threshold=null: thresholds.json; JSON keeps every digit of the scores compared with them
    rows = predict_rows(trained, "predict_tuned", f"topk={len(names)}", out="preds.json")
    assert "per-class thresholds from" in capfd.readouterr().err
    assert len(set(t.round(6))) > 1  # per class, not one number
    for row in rows:
        s = all_scores(row, names)
        expected = [n for n, v, tc in sorted(zip(names, s, t), key=lambda z: -z[1]) if v >= tc]
        assert row["labels"] == expected, row["path"]


def test_eval_after_tuning_reports_the_test_split_at_the_tuned_thresholds(trained, capfd):
    """eval split=test with a thresholds.json of this checkpoint: predictions.csv's predicted column, the
    *_tuned metrics and the per-class F1 table are at those thresholds (sklearn on the written scores);
    the logged test/f1_* stay at module.threshold."""
    if not (trained["ckpt"].parent / "thresholds.json").is_file():
        evaluate(trained, "tune_first", "split=val", "tune_thresholds=true")
    record = json.loads((trained["ckpt"].parent / "thresholds.json").read_text())
    names = class_names(trained)
    t = np.array([record["thresholds"][n] for n in names])
    capfd.readouterr()
    metrics, out = evaluate(trained, "eval_tuned")
    assert "per-class thresholds from" in capfd.readouterr().err
    _, scores, target = read_multilabel_predictions(out / "predictions.csv")
    pred = (scores >= t).astype(int)
    kw = dict(zero_division=0)
    assert metrics["test/f1_macro_tuned"] == pytest.approx(f1_score(target, pred, average="macro", **kw), abs=1e-9)
    assert metrics["test/f1_micro_tuned"] == pytest.approx(f1_score(target, pred, average="micro", **kw), abs=1e-9)
    assert metrics["test/f1_example_tuned"] == pytest.approx(f1_score(target, pred, average="samples", **kw), abs=1e-9)
    at_default = (scores >= THRESHOLD).astype(int)
    assert metrics["test/f1_macro"] == pytest.approx(f1_score(target, at_default, average="macro", **kw), abs=1e-6)
    assert (pred != at_default).any()  # the tuned thresholds change some decisions: the two are told apart
    with (out / "predictions.csv").open(newline="") as f:
        written = [set(r["predicted"].split(";")) - {""} for r in csv.DictReader(f)]
    assert written == [{n for n, v in zip(names, row) if v} for row in pred]
    with (out / "report" / "per_class.csv").open() as f:
        table = {r["class"]: r for r in csv.DictReader(f)}
    f1 = f1_score(target, pred, average=None, **kw)
    for c, name in enumerate(names):
        assert float(table[name]["f1"]) == pytest.approx(f1[c], abs=1e-5), name
    assert "per-class thresholds (thresholds.json)" in (out / "report" / "report.md").read_text()


def test_thresholds_of_another_checkpoint_are_not_applied(trained, tmp_path, capfd):
    import shutil

    from vitpipe.inference.load import load_predictor

    other = tmp_path / "checkpoints" / trained["ckpt"].name
    other.parent.mkdir()
    shutil.copyfile(trained["ckpt"], other)
    record = json.loads((trained["ckpt"].parent / "thresholds.json").read_text())
    record["global_step"] = (record["global_step"] or 0) + 1  # fitted on another save under this name
    (other.parent / "thresholds.json").write_text(json.dumps(record))
    loaded = load_predictor(other)
    assert "is not applied" in capfd.readouterr().err
    assert torch.equal(loaded.thresholds, torch.full((len(class_names(trained)),), THRESHOLD, dtype=torch.float64))


# ---- serve --------------------------------------------------------------------------------------


def test_endpoint_answers_the_label_set_of_predicts_row(trained):
    import base64

    from vitpipe.tasks.serving.api import ImageAPI

    names = class_names(trained)
    rows = {Path(r["path"]).name: r for r in predict_rows(trained, "serve_ref", "topk=3")}
    api = ImageAPI(ckpt_path=str(trained["ckpt"]), paths={"log_dir": "logs", "data_dir": "data"}, topk=3,
                   max_batch_size=8)
    api.setup("cpu")
    assert api.loaded.kind.name == "multilabel" and len(api.loaded.thresholds) == len(names)
    files = sorted((trained["root"] / "test").rglob("*.png"))[:8]
    payloads = [{"image": base64.b64encode(p.read_bytes()).decode()} for p in files]
    out = api.predict(api.batch([api.decode_request(p) for p in payloads]))
    some = 0
    for path, response in zip(files, map(api.encode_response, api.unbatch(out))):
        assert response.status_code == 200
        body, row = json.loads(response.body), rows[path.name]
        assert body["labels"] == (row["labels"].split(";") if row["labels"] else [])
        assert body["probs"] == pytest.approx([float(p) for p in row["probs"].split(";")] if row["probs"] else [], abs=1e-5)
        assert body["topk"]["labels"] == [row[f"top{r}_label"] for r in (1, 2, 3)]
        assert body["topk"]["probs"] == pytest.approx([float(row[f"top{r}_prob"]) for r in (1, 2, 3)], abs=1e-5)
        some += len(body["labels"])
    assert some > 0


def test_info_says_the_endpoint_answers_label_sets_at_these_thresholds(trained, tmp_path):
    """/info of a multi-label checkpoint: task multilabel and the per-class thresholds the answers apply."""
    from vitpipe.inference.load import load_predictor
    from vitpipe.tasks.serve import server_info

    cfg = make_cfg(tmp_path / "s", [f"ckpt_path={trained['ckpt']}", "device=cpu"], config_name="serve")
    loaded = load_predictor(trained["ckpt"])
    info = server_info(cfg, loaded, None)
    names = class_names(trained)
    assert info["task"] == "multilabel" and info["classes"] == names
    assert info["thresholds"] == {n: float(t) for n, t in zip(names, loaded.thresholds.tolist())}
    json.dumps(info)  # LitServe answers it as JSON


# ---- export -------------------------------------------------------------------------------------


def export(trained, fmt: str, out: Path) -> Path:
    from vitpipe.tasks.export import export as run_export

    return run_export(make_cfg(out.parent, [f"ckpt_path={trained['ckpt']}", f"format={fmt}", f"out={out}"],
                               config_name="export"))


def test_the_model_cards_sigmoid_snippet_gives_predicts_label_sets(trained, tmp_path, monkeypatch):
    """timm export: config.json says multi_label with the thresholds predict applies; the card's usage
    block, run as a reader would, gives predict's label set and scores per file."""
    import re

    from vitpipe.inference.load import load_predictor

    names = class_names(trained)
    out = export(trained, "timm", tmp_path / "ml_vit")
    config = json.loads((out / "config.json").read_text())
    thresholds = load_predictor(trained["ckpt"]).thresholds.tolist()
    assert config["multi_label"] is True
    assert config["thresholds"] == pytest.approx(thresholds, abs=0) and config["label_names"] == names
    readme = (out / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert ".sigmoid()" in code and "thresholds" in code and "softmax" not in code
    rows = {Path(r["path"]).name: r for r in predict_rows(trained, "card_ref", f"topk={len(names)}", out="p.json")}
    monkeypatch.chdir(tmp_path)
    files = sorted((trained["root"] / "test").rglob("*.png"))[:6]
    some = 0
    for f in files:
        scope: dict = {}
        exec(compile(code.replace('"image.png"', repr(str(f))), "README.md", "exec"), scope)  # our own card
        row = rows[f.name]
        assert scope["labels"] == sorted(row["labels"], key=names.index), f.name
        np.testing.assert_allclose(scope["scores"].detach().numpy(), all_scores(row, names), atol=1e-5)
        some += len(scope["labels"])
    assert some > 0


def test_onnx_export_metadata_says_sigmoid_and_the_thresholds(trained, tmp_path):
    import onnxruntime as ort

    out = export(trained, "onnx", tmp_path / "ml.onnx")
    meta = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    from vitpipe.inference.load import load_predictor

    assert meta["multi_label"] == "true" and "sigmoid" in meta["outputs"]
    assert json.loads(meta["thresholds"]) == pytest.approx(load_predictor(trained["ckpt"]).thresholds.tolist(), abs=0)
    assert json.loads(meta["label_names"]) == class_names(trained)


# ---- gradient rollout of a chosen class ----------------------------------------------------------


def test_gradient_rollout_explains_the_class_target_names(trained, tmp_path):
    from vitpipe.inference.labels import class_index
    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.tasks.visualize import classifier_maps, visualize
    from vitpipe.viz.rollout import gradient_rollout

    names = class_names(trained)
    cfg = make_cfg(tmp_path, [f"ckpt_path={trained['ckpt']}", f"images={trained['root'] / 'test'}", "method=gradient",
                              f"target={names[3]}", "num_images=2", "per_image=false", "device=cpu",
                              f"out={tmp_path / 'figs'}"], config_name="visualize")
    written = visualize(cfg)
    assert [p.name for p in written] == ["gradient_grid.png"]
    net = rebuild(load_checkpoint(trained["ckpt"]), trained["ckpt"]).net
    assert class_index(names[3], names, len(names)) == 3 and class_index("7", names, len(names)) == 7
    x = torch.randn(2, net.in_chans, 56, 56, generator=torch.Generator().manual_seed(0))
    maps = [classifier_maps(net, x, ["gradient"], head_fusion="mean", discard_ratio=0.0, target=c,
                                  kind=KINDS["multilabel"])
            for c in (3, 5)]
    torch.testing.assert_close(maps[0]["gradient"], gradient_rollout(net, x, 3))
    assert not torch.allclose(maps[0]["gradient"], maps[1]["gradient"])  # another class, another map
    torch.testing.assert_close(maps[0]["probs"], net(x).sigmoid())
    with pytest.raises(ConfigError, match="not a class of this checkpoint"):
        class_index("Zebra", names, len(names))


# ---- refusals elsewhere --------------------------------------------------------------------------


def test_demo_page_shows_predicts_label_set_and_scores(trained, tmp_path):
    """The demo's answer for a multi-label checkpoint: predict's label set (at the same thresholds) and
    top-k sigmoid scores per file, gradient rollout of the highest-scoring class, test mAP in the facts."""
    from vitpipe.tasks import demo as demo_task
    from vitpipe.tasks import demo_model
    from vitpipe.viz.rollout import gradient_rollout

    names = class_names(trained)
    rows = {Path(r["path"]).name: r for r in predict_rows(trained, "demo_ref", "topk=3")}
    model = demo_model.load_model(make_cfg(tmp_path / "d", [f"ckpt_path={trained['ckpt']}", "device=cpu"],
                                          config_name="demo"))
    assert "multi-label" in model.facts["Data"] and "Test mAP" in model.facts
    some = 0
    for path in sorted((trained["root"] / "test").rglob("*.png"))[:6]:
        shown = demo_model.show(model, path, "gradient", topk=3)
        row = rows[path.name]
        assert shown.labels == (row["labels"].split(";") if row["labels"] else [])
        assert list(shown.probs) == [row[f"top{r}_label"] for r in (1, 2, 3)]
        assert list(shown.probs.values()) == pytest.approx([float(row[f"top{r}_prob"]) for r in (1, 2, 3)], abs=1e-5)
        x = demo_model.model_input(model, path)
        top = names.index(row["top1_label"])
        torch.testing.assert_close(shown.attention, gradient_rollout(model.net, x, top)[0].detach())
        text = demo_model.label_set_text(shown.labels, shown.probs)
        assert all(n in text for n in shown.labels)
        some += len(shown.labels)
    assert some > 0
    # the page's own callback answers into its four outputs: the label set line, the bars, the two images
    cfg = make_cfg(tmp_path / "p", [f"ckpt_path={trained['ckpt']}", "device=cpu"], config_name="demo")
    page = demo_task.build_page(model, cfg, [])
    on_image = next(f for f in page.fns.values() if len(f.inputs) == 2)
    answer = on_image.fn(str(path), "gradient")
    shown = demo_model.show(model, path, "gradient", topk=cfg.topk)
    assert len(answer) == len(on_image.outputs) == 4
    assert answer[0] == demo_model.label_set_text(shown.labels, shown.probs) and answer[1] == shown.probs
    np.testing.assert_array_equal(answer[3], shown.overlay)


def test_serve_checks_threshold_in_one_line(trained, tmp_path):
    from vitpipe.config.options import check_serve as check_options

    with pytest.raises(ConfigError, match="threshold=2"):
        check_options(make_cfg(tmp_path / "s", [f"ckpt_path={trained['ckpt']}", "threshold=2"], config_name="serve"))

"""The per-run report: history.csv, predictions.csv, report/ (per-class, confusion, calibration,
curves, errors, report.md), ECE and temperature scaling. Every number is checked against an
independent recomputation (sklearn, torchmetrics, hand-made known answers)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_cfg
from PIL import Image

from vitpipe.report.calibration import expected_calibration_error, fit_temperature, nll, reliability_bins
from vitpipe.report.figures import CALIBRATION_SIZE, CURVES_SIZE, DPI, confusion_figure, confusion_size, errors_size
from vitpipe.report.history import HistoryCallback, read_history
from vitpipe.report.per_class import confusion_counts, row_normalise
from vitpipe.report.predictions import read_predictions

# 4-px patches, no augmentation: the tiny ViT gets well above chance in 40 steps, so the confusion
# matrix and the mistakes are not one column; the whole test split (360 digits) is evaluated.
RUN = ["debug=fast", "logger=none", "model.patch_size=4", "data.augment=false", "trainer.max_epochs=2",
       "trainer.limit_train_batches=20", "trainer.limit_test_batches=1.0", "callbacks.progress_bar.refresh_rate=1000",
       "callbacks.model_checkpoint.save_top_k=-1"]
DIGITS_TEST = 360


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """One tiny training run with the default callbacks: its run directory and metrics."""
    from vitpipe.tasks.train import train

    cfg = make_cfg(tmp_path_factory.mktemp("report"), RUN)
    metrics = train(cfg)
    return SimpleNamespace(dir=Path(cfg.paths.output_dir), metrics=metrics, cfg=cfg)


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ---- ECE and temperature scaling: known answers ------------------------------------------------


def test_ece_known_answers():
    n = 3000
    # perfectly calibrated: in each confidence group exactly that fraction is right -> 0
    conf = torch.tensor([0.25] * 1000 + [0.55] * 1000 + [0.95] * 1000)
    correct = torch.zeros(n, dtype=torch.bool)
    correct[:250], correct[1000:1550], correct[2000:2950] = True, True, True
    assert expected_calibration_error(conf, correct) == pytest.approx(0.0, abs=1e-6)  # float32 inputs
    # a fixed over-confidence: 0.9 claimed, 60% right -> a gap of 0.3
    conf = torch.full((n,), 0.9)
    correct = torch.arange(n) < 0.6 * n
    assert expected_calibration_error(conf, correct) == pytest.approx(0.3, abs=1e-6)
    # two bins of different weight: |0.9 - 0.6| * 2/3 + |0.35 - 0.35| * 1/3
    conf = torch.tensor([0.9] * 200 + [0.35] * 100)
    correct = torch.tensor([True] * 120 + [False] * 80 + [True] * 35 + [False] * 65)
    assert expected_calibration_error(conf, correct) == pytest.approx(0.2, abs=1e-6)
    # the reliability bins give the same number, and so does torchmetrics on full probabilities
    bins = reliability_bins(conf, correct)
    assert float((bins["count"] * (bins["accuracy"] - bins["confidence"]).abs()).sum() / 300) == pytest.approx(0.2)
    from torchmetrics.classification import MulticlassCalibrationError

    logits = torch.randn(500, 7, generator=torch.Generator().manual_seed(0)) * 3
    target = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    tm = MulticlassCalibrationError(num_classes=7, n_bins=15, norm="l1")(probs, target)
    assert expected_calibration_error(probs.max(-1).values, probs.argmax(-1) == target) == pytest.approx(float(tm))


def test_temperature_scaling_lowers_nll_of_an_overconfident_model_and_keeps_its_predictions():
    g = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 10, generator=g) * 1.5  # the labels are drawn from these: calibrated
    target = torch.multinomial(true_logits.softmax(-1), 1, generator=g)[:, 0]
    over = 3.0 * true_logits  # the same ranking, three times too sure
    val, test = slice(0, 2000), slice(2000, None)
    t = fit_temperature(over[val], target[val])
    print(f"fitted T = {t:.3f} (true over-confidence 3.0)")
    assert t == pytest.approx(3.0, rel=0.1)
    assert nll(over[val], target[val], t) < nll(over[val], target[val]) - 0.1
    assert nll(over[test], target[test], t) < nll(over[test], target[test]) - 0.1
    assert torch.equal((over / t).argmax(-1), over.argmax(-1))
    ece = lambda z: expected_calibration_error(z.softmax(-1).max(-1).values, z.argmax(-1) == target[test])  # noqa: E731
    assert ece(over[test] / t) < ece(over[test]) / 2


# ---- the run's files ---------------------------------------------------------------------------


def test_predictions_cover_the_test_set_once_and_match_test_acc(run):
    rows = _csv(run.dir / "predictions.csv")
    assert len(rows) == DIGITS_TEST
    assert sorted(int(r["index"]) for r in rows) == list(range(DIGITS_TEST))
    from vitpipe.data import DigitsDataModule

    dm = DigitsDataModule(img_size=8, in_chans=1, num_classes=10, channels=1)
    dm.setup("test")
    assert [int(r["target"]) for r in rows] == dm.data_test.labels.tolist()  # index -> the right image
    acc = np.mean([r["target"] == r["pred"] for r in rows])
    metrics = json.loads((run.dir / "metrics.json").read_text())
    print(f"test/acc {metrics['test/acc']:.4f}, from predictions.csv {acc:.4f}")
    assert acc == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert acc > 0.2  # the fixture's model is past chance (0.1): the checks below are not trivial
    preds = read_predictions(run.dir / "predictions.csv")
    assert preds.ece() == pytest.approx(metrics["test/ece"], abs=1e-4)  # CSV probabilities have 6 digits
    assert all(0 < float(r["prob_target"]) <= float(r["prob"]) + 1e-9 <= 1 + 1e-9 for r in rows)


def test_confusion_matrix_and_per_class_metrics_equal_sklearn_recomputed_from_predictions(run):
    from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score

    rows = _csv(run.dir / "predictions.csv")
    y, p = [int(r["target"]) for r in rows], [int(r["pred"]) for r in rows]
    labels = list(range(10))
    saved = [[int(v) for v in list(r.values())[1:]] for r in _csv(run.dir / "report" / "confusion_matrix.csv")]
    np.testing.assert_array_equal(np.array(saved), confusion_matrix(y, p, labels=labels))
    per_class = _csv(run.dir / "report" / "per_class.csv")
    assert [r["name"] for r in per_class] == [str(d) for d in range(10)]
    for key, fn in (("recall", recall_score), ("precision", precision_score), ("f1", f1_score)):
        np.testing.assert_allclose([float(r[key]) for r in per_class], fn(y, p, labels=labels, average=None,
                                                                            zero_division=0), atol=1e-5)
    assert sum(int(r["support"]) for r in per_class) == DIGITS_TEST
    # the diagonal of the row-normalised matrix (what the picture shows) is the per-class recall
    norm = row_normalise(confusion_counts(torch.tensor(y), torch.tensor(p), 10))
    np.testing.assert_allclose(norm.diag().numpy(), [float(r["recall"]) for r in per_class], atol=1e-5)


def test_report_pngs_are_valid_images_of_the_expected_size(run):
    expected = {"confusion_matrix": confusion_size(10), "calibration": CALIBRATION_SIZE, "curves": CURVES_SIZE,
                "errors": errors_size(16)}
    for name, (w, h) in expected.items():
        path = run.dir / "report" / f"{name}.png"
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size == (round(w * DPI), round(h * DPI)), name
            assert np.asarray(im.convert("L")).std() > 5, f"{name}.png is blank"


def test_report_md_links_exist_and_the_table_has_the_numbers(run):
    md = (run.dir / "report" / "report.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", md)
    assert {"confusion_matrix.png", "calibration.png", "curves.png", "errors.png", "per_class.csv"} <= set(links)
    for link in links:
        assert (run.dir / "report" / link).is_file(), link
    acc = json.loads((run.dir / "metrics.json").read_text())["test/acc"]
    assert f"| accuracy | {acc:.4f} |" in md


def test_history_has_one_row_per_epoch_with_the_logged_values(run):
    rows = read_history(run.dir / "history.csv")
    assert [r["epoch"] for r in rows] == [0, 1] and [r["step"] for r in rows] == [20, 40]
    assert {"lr", "train/loss", "train/acc", "val/loss", "val/acc"} <= set(rows[0])
    # the last row's values are the run's final epoch metrics
    assert rows[-1]["val/acc"] == pytest.approx(run.metrics["val/acc"], rel=1e-5)
    assert rows[-1]["train/loss"] == pytest.approx(run.metrics["train/loss"], rel=1e-5)


def test_resumed_run_writes_the_whole_history_once(run, tmp_path):
    from vitpipe.tasks.train import train

    ckpt = run.dir / "checkpoints" / "epoch_000.ckpt"
    cfg = make_cfg(tmp_path, [*RUN, "trainer.max_epochs=3", "test=false", f"ckpt_path={ckpt}"])
    train(cfg)
    first, resumed = read_history(run.dir / "history.csv"), read_history(Path(cfg.paths.output_dir) / "history.csv")
    assert [r["epoch"] for r in resumed] == [0, 1, 2]  # epoch 0 from the checkpoint, 1-2 trained again
    assert resumed[0] == first[0]


def test_history_drops_rows_of_the_epoch_a_resume_restarts():
    cb = HistoryCallback()
    cb.load_state_dict({"rows": [{"epoch": e, "step": 10 * e} for e in range(3)]})
    cb.on_train_epoch_start(SimpleNamespace(current_epoch=1), None)
    assert [r["epoch"] for r in cb.rows] == [0]


def test_confusion_figure_is_readable_at_10_and_100_classes():
    for c, numbers in ((10, True), (100, False)):
        norm = row_normalise(torch.eye(c, dtype=torch.long) * 5 + 1)
        fig = confusion_figure(norm, [f"class {i}" for i in range(c)])
        ax = fig.axes[0]
        assert len(ax.get_xticklabels()) == c and ax.get_yticklabels()[-1].get_text() == f"class {c - 1}"
        assert (len(ax.texts) > 0) == numbers  # per-cell numbers only when there are few classes
        assert tuple(fig.get_size_inches()) == confusion_size(c)


def test_figures_go_to_tensorboard(tmp_path, run):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vitpipe.report.callback import log_figures

    tb = TensorBoardLogger(str(tmp_path), name="tb", version="")
    figures = {p.stem: p for p in (run.dir / "report").glob("*.png")}
    log_figures(SimpleNamespace(loggers=[tb], global_step=7), figures)
    tb.experiment.flush()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0}).Reload()
    assert set(acc.Tags()["images"]) == {f"report/{name}" for name in figures}


# ---- scripts/eval.py: the same report for any checkpoint, split, calibration, TTA ---------------


def _evaluate(run, tmp_path, *overrides):
    from vitpipe.tasks.evaluate import evaluate

    cfg = make_cfg(tmp_path, [f"ckpt_path={run.dir}", "trainer.accelerator=cpu", "trainer.precision=32-true",
                              "+trainer.enable_progress_bar=false", *overrides], config_name="eval")
    return evaluate(cfg), Path(cfg.paths.output_dir)


def test_eval_calibrate_fits_on_val_writes_calibration_json_and_keeps_predictions(run, tmp_path):
    metrics, out = _evaluate(run, tmp_path, "calibrate=true")
    best = next((run.dir / "checkpoints").glob("epoch_*.ckpt"))  # ckpt_path=<run dir> evaluates the best
    cal = json.loads((best.parent / "calibration.json").read_text())
    print({k: round(v, 4) for k, v in cal.items() if isinstance(v, float)})
    assert cal["temperature"] == pytest.approx(metrics["test/temperature"]) and cal["temperature"] > 0
    assert cal["val_nll_after"] < cal["val_nll_before"]  # what the fit minimised, on the split it saw
    assert metrics["test/nll"] == pytest.approx(cal["test_nll_after"])
    assert {"test/ece", "test/ece_uncalibrated", "test/nll_uncalibrated"} <= set(metrics)
    # dividing logits by T changes no prediction: the report's predictions are the training run's
    ours, theirs = _csv(out / "predictions.csv"), _csv(run.dir / "predictions.csv")
    assert [r["pred"] for r in ours] == [r["pred"] for r in theirs]
    assert metrics["test/acc"] == pytest.approx(run.metrics["test/acc"], abs=1e-6)
    assert read_predictions(out / "predictions.csv").ece() == pytest.approx(metrics["test/ece"], abs=1e-4)
    assert (out / "report" / "curves.png").is_file()  # the training history was brought along


def test_eval_split_val_reports_the_validation_split(run, tmp_path):
    metrics, out = _evaluate(run, tmp_path, "split=val")
    rows = _csv(out / "predictions.csv")
    assert len(rows) == 144  # digits: 10% of the 1437 training images
    assert np.mean([r["target"] == r["pred"] for r in rows]) == pytest.approx(metrics["val/acc"], abs=1e-6)
    assert "# Evaluation report: val split" in (out / "report" / "report.md").read_text()


def test_eval_option_mistakes_are_one_line_errors(run, tmp_path):
    from vitpipe.errors import ConfigError

    for bad, match in (("split=train", "split='train'; valid choices: test, val"),
                       ("tta=vflip", "tta='vflip'; valid choices: none, hflip")):
        with pytest.raises(ConfigError, match=match):
            _evaluate(run, tmp_path / bad.split("=")[0], bad)


def test_tta_hflip_averages_the_softmax_of_the_image_and_its_mirror_and_temperature_divides():
    from vitpipe import create_model
    from vitpipe.inference.tta import at_test_time

    net = create_model("vit_micro", num_classes=5, depth=1, img_size=16, patch_size=4).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        plain, mirror = net(x).softmax(-1), net(x.flip(-1)).softmax(-1)
        with at_test_time(net, tta="hflip"):
            tta = net(x).softmax(-1)
        with at_test_time(net, temperature=2.0):
            scaled = net(x)
        after = net(x).softmax(-1)
    torch.testing.assert_close(tta, (plain + mirror) / 2)
    torch.testing.assert_close(scaled.softmax(-1), (plain.log() / 2).softmax(-1))
    torch.testing.assert_close(after, plain)  # the hooks are gone afterwards


def test_early_stopping_option_stops_when_the_monitored_metric_stalls(tmp_path):
    from vitpipe.tasks.train import train

    # min_delta 1.0: no epoch can improve val/acc by that much, so patience 1 stops after epoch 1
    cfg = make_cfg(tmp_path, ["debug=fast", "logger=none", "test=false", "trainer.max_epochs=5",
                              "callbacks=early_stopping", "callbacks.early_stopping.patience=1",
                              "callbacks.early_stopping.min_delta=1.0", "callbacks.progress_bar.refresh_rate=1000"])
    train(cfg)
    assert [r["epoch"] for r in read_history(Path(cfg.paths.output_dir) / "history.csv")] == [0, 1]


@pytest.mark.slow  # 17-25 s of subprocesses: .ci/run runs it after the default suite
def test_ddp_two_processes_write_each_test_image_once(tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ddp"
    # 101 test images: unequal shards (51 and 50), which a padded sampler would round up to 2 x 51
    args = ["debug=fast", "logger=none", "trainer=ddp_cpu", "trainer.devices=2", "trainer.limit_train_batches=1",
            "trainer.limit_val_batches=1", "trainer.limit_test_batches=1.0", "data=synthetic", "data.length=64",
            "data.test_length=101", "data.native_size=8", "data.eval_batch_size=16",
            "callbacks.progress_bar.refresh_rate=1000", f"hydra.run.dir={out}"]
    r = subprocess.run([sys.executable, str(root / "scripts" / "train.py"), *args], capture_output=True, text=True,
                       timeout=600, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _csv(out / "predictions.csv")
    assert sorted(int(r["index"]) for r in rows) == list(range(101))  # every image, once
    from vitpipe.data import SyntheticDataModule

    dm = SyntheticDataModule(img_size=8, in_chans=3, num_classes=10, channels=3, native_size=8, length=64,
                             test_length=101)
    dm.setup("test")
    assert [int(r["target"]) for r in rows] == dm.data_test.labels.tolist()  # each index names its image
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.mean([r["target"] == r["pred"] for r in rows]) == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert read_predictions(out / "predictions.csv").ece() == pytest.approx(metrics["test/ece"], abs=1e-4)
    assert (out / "report" / "report.md").is_file()


# ---- imbalanced data: class-weighted loss, class-balanced sampler, early stopping ---------------


def _imbalanced_folder(root: Path, n_major=200, n_minor=20, n_test=100, shift=8, seed=0) -> Path:
    """8x8 RGB noise, the minority class redder and the majority greener by ``shift`` per pixel:
    separable on average but overlapping, so a 10:1 prior pulls the decision towards the majority."""
    rng = np.random.default_rng(seed)
    for split, counts in (("train", (n_major, n_minor)), ("test", (n_test, n_test))):
        for cls, n, sign in (("major", counts[0], -1), ("minor", counts[1], 1)):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 200, size=(8, 8, 3)).astype(np.int16)
                img[..., 0] += 28 + sign * shift
                img[..., 1] += 28 - sign * shift
                Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_balanced_loss_and_sampler_raise_minority_recall_on_10_to_1_data(tmp_path):
    from vitpipe.tasks.train import train

    data = _imbalanced_folder(tmp_path / "data")
    recall = {}
    for name, extra in (("plain", []), ("weights", ["module.class_weights=balanced"]),
                        ("sampler", ["data.sampler=balanced"])):
        cfg = make_cfg(tmp_path / name, [
            "debug=fast", "logger=none", "seed=0", "data=imagefolder", f"data.root={data}", "data.num_classes=2",
            "data.num_workers=0", "data.augment=false", "data.batch_size=32", "model.patch_size=4",
            "trainer.max_epochs=10", "trainer.limit_train_batches=null", "trainer.limit_val_batches=null",
            "trainer.limit_test_batches=null", "callbacks.progress_bar.refresh_rate=1000", *extra])
        train(cfg)
        rows = {r["name"]: r for r in _csv(Path(cfg.paths.output_dir) / "report" / "per_class.csv")}
        assert int(rows["minor"]["support"]) == int(rows["major"]["support"]) == 100
        recall[name] = float(rows["minor"]["recall"])
    # the README's run, seed 0: plain 0.39, weights 0.94, sampler 0.81 (seed 1: 0.68/0.86/0.85, 2: 0.40/0.80/0.90)
    print(f"minority-class recall: {recall}")
    assert recall["weights"] >= recall["plain"] + 0.1
    assert recall["sampler"] >= recall["plain"] + 0.1


def test_balanced_sampler_shards_over_ranks_resumes_exactly_and_balances_classes():
    from vitpipe.data.balance import BalancedSampler

    labels = torch.cat([torch.zeros(1000, dtype=torch.long), torch.ones(100, dtype=torch.long)])  # 10:1
    ranks = [BalancedSampler(labels, num_replicas=2, rank=r, seed=3) for r in range(2)]
    for s in ranks:
        s.set_epoch(4)
    a, b = list(ranks[0]), list(ranks[1])
    assert len(a) == len(b) == 550  # equal step counts on every rank
    drawn = [i for pair in zip(a, b) for i in pair]  # order[rank::2] interleaved back
    assert drawn == ranks[0]._order().tolist()
    minority = labels[torch.tensor(drawn)].float().mean().item()
    assert 0.45 < minority < 0.55  # ~half the draws from the class with 1/11 of the images
    # resume: the same epoch again, skipping what was trained, gives the rest of the same order
    again = BalancedSampler(labels, num_replicas=2, rank=0, seed=3)
    again.set_epoch(4)
    again.skip = 200
    assert list(again) == a[200:]
    again.set_epoch(5)
    assert list(again) != a  # a new epoch draws anew


def test_balanced_class_weights_and_option_mistakes(cfg_factory):
    from vitpipe.data.balance import balanced_class_weights
    from vitpipe.errors import ConfigError
    from vitpipe.run.build import build_from_config

    counts = torch.tensor([200, 20, 0])
    w = balanced_class_weights(counts)
    torch.testing.assert_close(w, torch.tensor([220 / 400, 220 / 40, 0.0]))
    assert float((w * counts).sum()) == pytest.approx(220)  # the mean weight per image is 1
    for bad, match in (("data.sampler=weighted", "data.sampler='weighted'; valid choices: default, balanced"),
                       ("data.shuffle=false", "cannot honour data.shuffle=false"),
                       ("module.class_weights=[1,2,3]", r"module.class_weights=\[1, 2, 3\]: use balanced, null or 10")):
        extra = ["data.sampler=balanced"] if bad == "data.shuffle=false" else []
        with pytest.raises(ConfigError, match=match):
            build_from_config(cfg_factory("debug=fast", bad, *extra))


def test_figures_go_to_wandb_as_images(run, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    from vitpipe.report.callback import log_figures

    logged = {}
    monkeypatch.setattr(WandbLogger, "log_image", lambda self, key, images, step=None, **kw: logged.update(
        {key: (images[0].shape, step)}))
    figures = {p.stem: p for p in (run.dir / "report").glob("*.png")}
    log_figures(SimpleNamespace(loggers=[WandbLogger.__new__(WandbLogger)], global_step=3), figures)
    with Image.open(figures["calibration"]) as im:
        size = im.size
    assert set(logged) == {f"report/{name}" for name in figures}
    assert logged["report/calibration"] == ((size[1], size[0], 3), 3)  # (H, W, RGB) pixels at the run's step


def test_readme_example_report_is_recomputed_from_its_csvs(tmp_path):
    import shutil

    from vitpipe.report import write_report

    example = Path(__file__).resolve().parents[1] / "notebooks" / "figures" / "example_report"
    shutil.copytree(example, tmp_path / "run")
    for f in ("per_class.csv", "confusion_matrix.csv", "report.md"):
        (tmp_path / "run" / "report" / f).unlink()
    metrics = {k: v for k, v in json.loads((example / "metrics.json").read_text()).items() if k.startswith("test/")}
    write_report(tmp_path / "run", [str(d) for d in range(10)], metrics=metrics)
    for f in ("per_class.csv", "confusion_matrix.csv"):
        assert (tmp_path / "run" / "report" / f).read_text() == (example / "report" / f).read_text()
    md = (tmp_path / "run" / "report" / "report.md").read_text().replace("`run`", "`default_run`")
    assert md == (example / "report" / "report.md").read_text()


def test_tta_hflip_on_a_run_trained_without_flips_warns_once_before_evaluating(run, tmp_path, capsys):
    """The fixture's run trained without flips (data.augment=false; digits have data.hflip=false): mirror
    TTA shows it images it never saw, so eval says so in one line; without tta it says nothing."""
    _evaluate(run, tmp_path / "plain")
    assert "tta=hflip" not in capsys.readouterr().err
    _evaluate(run, tmp_path / "tta", "tta=hflip")
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vitpipe: warning:")]
    assert len(lines) == 1, lines
    assert "tta=hflip" in lines[0] and "without flips" in lines[0] and "data.augment=false" in lines[0]


def test_flip_warning_reads_the_training_config_stored_in_the_checkpoint():
    from vitpipe.report.evaluation import unseen_flip_warning

    flipped = {"data": {"_target_": "vitpipe.data.CIFAR10DataModule", "augment": True, "hflip": True}}
    assert unseen_flip_warning(flipped, "hflip") is None
    assert unseen_flip_warning({"data": {"hflip": True}}, "hflip") is None  # augment defaults to on
    assert unseen_flip_warning({"data": {"hflip": False}}, "none") is None  # no TTA, nothing to say
    assert "data.hflip=false" in unseen_flip_warning({"data": {"augment": True, "hflip": False}}, "hflip")
    assert "data.augment=false" in unseen_flip_warning({"data": {"augment": False, "hflip": True}}, "hflip")
    assert "no flip augmentation" in unseen_flip_warning({"data": {"augment": True}}, "hflip")
    assert "no flip augmentation" in unseen_flip_warning({}, "hflip")
    assert "\n" not in unseen_flip_warning({"data": {"hflip": False}}, "hflip")

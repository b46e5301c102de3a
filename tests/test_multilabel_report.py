"""The multi-label report's figures: precision-recall curves (sklearn's curve data, the operating point at
the thresholds), label co-occurrence (true and predicted, equal to M.T @ M computed by hand), the gallery of
the most confident false positives and missed labels (a known answer, ties included), and a real eval of a
tiny multi-label checkpoint whose report.md links PNGs that exist at their stated sizes."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg
from PIL import Image
from sklearn.metrics import average_precision_score, precision_recall_curve, precision_score, recall_score

from vitpipe.report.figures import DPI, PR_SIZE, co_occurrence_size, label_errors_size
from vitpipe.report.multilabel import (
    confident_label_errors,
    pr_curves,
    read_co_occurrence,
    write_multilabel_report,
)
from vitpipe.report.predictions import MultilabelPredictions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NAMES = ["cat", "dog", "owl", "bee"]


def hand_co_occurrence(m: np.ndarray) -> np.ndarray:
    """Count, for every pair of classes, the images whose label set holds both: loops, no matrix product."""
    c = m.shape[1]
    out = np.zeros((c, c), dtype=np.int64)
    for row in m:
        for i in range(c):
            for j in range(c):
                out[i, j] += int(row[i] == 1 and row[j] == 1)
    return out


def random_run(tmp_path: Path, n: int = 40, seed: int = 0) -> tuple[Path, np.ndarray, np.ndarray]:
    """A run dir with a predictions.csv of n images, 4 classes (every class present and absent somewhere)."""
    rng = np.random.default_rng(seed)
    target = (rng.random((n, len(NAMES))) < 0.4).astype(np.int64)
    target[0], target[1] = 1, 0
    logits = rng.normal(size=(n, len(NAMES))) + 1.5 * (target - 0.5)
    preds = MultilabelPredictions.from_logits(torch.arange(n), torch.tensor(logits, dtype=torch.float32),
                                              torch.tensor(target, dtype=torch.float32), threshold=0.5)
    preds.write(tmp_path / "predictions.csv", NAMES)
    return tmp_path, preds.scores.numpy(), target


# ---- co-occurrence -----------------------------------------------------------------------------


@pytest.mark.parametrize("per_class", [False, True])
def test_co_occurrence_csv_is_target_t_target_and_pred_t_pred(tmp_path, per_class):
    run, scores, target = random_run(tmp_path)
    thresholds = np.array([0.3, 0.5, 0.6, 0.7]) if per_class else 0.5
    write_multilabel_report(run, threshold=thresholds)
    got = read_co_occurrence(run / "report" / "co_occurrence.csv")
    pred = (scores >= np.asarray(thresholds)).astype(np.int64)
    np.testing.assert_array_equal(got["true"], hand_co_occurrence(target))
    np.testing.assert_array_equal(got["predicted"], hand_co_occurrence(pred))
    np.testing.assert_array_equal(np.diag(got["true"]), target.sum(0))  # the diagonal is the support
    assert not np.array_equal(got["true"], got["predicted"])  # the two differ: each is checked on its own
    header = (run / "report" / "co_occurrence.csv").read_text().splitlines()[0]
    assert header == "matrix,class," + ",".join(NAMES)


# ---- gallery selection -------------------------------------------------------------------------


def test_confident_label_errors_known_answer_with_ties():
    scores = np.array([[0.90, 0.10, 0.70],
                       [0.70, 0.95, 0.20],
                       [0.20, 0.70, 0.05],
                       [0.60, 0.20, 0.99]])
    target = np.array([[0, 1, 0],
                       [1, 0, 1],
                       [1, 0, 1],
                       [0, 1, 1]])
    false_pos, missed = confident_label_errors(scores, target, n=4)
    # absent labels by score: (1,1) .95, (0,0) .90, then two tied at .70 by row: (0,2), (2,1); last (3,0) .60
    assert false_pos == [(1, 1), (0, 0), (0, 2), (2, 1)]
    # present labels, lowest first: (2,2) .05, (0,1) .10, then .20 tied: (1,2), (2,0), (3,1) -> the first two
    assert missed == [(2, 2), (0, 1), (1, 2), (2, 0)]
    fp_all, missed_all = confident_label_errors(scores, target, n=100)
    assert len(fp_all) == int((target == 0).sum()) and len(missed_all) == int(target.sum())
    assert fp_all[4:] == [(3, 0)] and missed_all[4:] == [(3, 1), (1, 0), (3, 2)]


def test_confident_label_errors_equal_a_sort_of_all_pairs(tmp_path):
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, (30, 6)) / 4  # many ties
    target = rng.integers(0, 2, (30, 6))
    false_pos, missed = confident_label_errors(scores, target, n=8)
    pairs = [(r, c) for r in range(30) for c in range(6)]
    assert false_pos == sorted((p for p in pairs if target[p] == 0), key=lambda p: (-scores[p], p))[:8]
    assert missed == sorted((p for p in pairs if target[p] == 1), key=lambda p: (scores[p], p))[:8]


def test_gallery_draws_the_chosen_images_and_is_skipped_without_images(tmp_path):
    run, scores, target = random_run(tmp_path, n=24)
    asked = []

    def image(i):
        asked.append(i)
        return np.full((8, 8, 3), 10 * i, dtype=np.uint8)

    paths = write_multilabel_report(run, threshold=0.5, image=image, num_errors=3)
    false_pos, missed = confident_label_errors(scores, target, n=3)
    assert sorted(asked) == sorted({r for r, _ in false_pos + missed})  # index == row here (arange)
    with Image.open(paths["label_errors"]) as im:
        assert im.size == tuple(round(DPI * s) for s in label_errors_size(3, 3))
    report = (run / "report" / "report.md").read_text()
    assert "![most confident label errors](label_errors.png)" in report and "skipped" not in report

    for unavailable in (None, lambda i: None):
        paths = write_multilabel_report(run, threshold=0.5, image=unavailable)
        report = (run / "report" / "report.md").read_text()
        assert "label_errors" not in paths and not (run / "report" / "label_errors.png").exists()
        skipped = [line for line in report.splitlines() if line.startswith("Gallery skipped:")]
        assert len(skipped) == 1 and "label_errors.png" not in report
        assert {"pr_curves", "co_occurrence"} <= set(paths) and (run / "report" / "per_class.csv").is_file()


# ---- precision-recall curves -------------------------------------------------------------------


def test_pr_curve_data_is_sklearns_with_the_operating_point_at_the_thresholds():
    rng = np.random.default_rng(1)
    c = 14
    target = (rng.random((60, c)) < 0.3).astype(np.int64)
    target[0] = 1
    target[:, 13] = 0  # no positives: never shown
    scores = np.clip(rng.random((60, c)) * 0.7 + 0.3 * target * np.linspace(0, 1, c), 0, 1)
    names = [f"c{k}" for k in range(c)]
    t = np.linspace(0.2, 0.8, c)
    curves = pr_curves(scores, target, t, names, k=3)
    ap = {k: average_precision_score(target[:, k], scores[:, k]) for k in range(13)}
    by_ap = sorted(ap, key=lambda k: ap[k])
    assert [cu["class"] for cu in curves] == by_ap[:3] + by_ap[-3:] + [None]
    for cu in curves:
        k = cu["class"]
        y, s = (target.ravel(), scores.ravel()) if k is None else (target[:, k], scores[:, k])
        p, r, _ = precision_recall_curve(y, s)
        np.testing.assert_array_equal(cu["precision"], p)
        np.testing.assert_array_equal(cu["recall"], r)
        assert cu["ap"] == pytest.approx(average_precision_score(y, s), abs=1e-12)
        pred = (scores >= t).ravel() if k is None else scores[:, k] >= t[k]
        assert cu["point"] == pytest.approx((recall_score(y, pred), precision_score(y, pred, zero_division=1)))
    # few classes: every class with positives, lowest AP first
    few = pr_curves(scores[:, :4], target[:, :4], 0.5, names[:4], k=3)
    assert [cu["class"] for cu in few] == sorted(range(4), key=lambda k: ap[k]) + [None]


# ---- a real eval -------------------------------------------------------------------------------


def tiny_multilabel_checkpoint(base: Path) -> tuple[Path, Path]:
    """An image folder with labels.csv (12 train, 6 test rows, 3 classes) and a random-weight multi-label
    checkpoint built as training builds one (tests/tiny_checkpoints.py's recipe)."""
    from omegaconf import OmegaConf

    from vitpipe.run.build import build_from_config

    root = base / "images"
    rng = np.random.default_rng(0)
    rows, sets = [], ["cat", "dog;owl", "owl", "cat;dog", "cat;dog;owl", "dog"]
    for i in range(18):
        (root / "img").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        rows.append(f"img/{i}.png,{sets[i % 6]},{'train' if i < 12 else 'test'}")
    (root / "labels.csv").write_text("path,labels,split\n" + "\n".join(rows) + "\n")
    cfg = make_cfg(base / "ckpt", ["debug=fast", "logger=none", "data=imagefolder", f"data.root={root}",
                                   "data.labels=labels.csv", "data.val_split=0", "module.task=multilabel",
                                   "model.img_size=16", "model.patch_size=4", "model.pos_embed=learned"])
    dm, net, module = build_from_config(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(mean=1.0 if "norm" in name and name.endswith("weight") else 0.0, std=0.2)
    dm.check()
    stored = OmegaConf.to_container(cfg, resolve=True)
    stored.pop("hydra", None)
    path = base / "ckpt" / "run" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save({"state_dict": module.state_dict(), "vitpipe_config": stored, "class_names": dm.class_names}, path)
    return path, root


def test_eval_report_links_the_pngs_and_they_exist(tmp_path):
    from vitpipe.tasks.evaluate import evaluate

    ckpt, root = tiny_multilabel_checkpoint(tmp_path)
    cfg = make_cfg(tmp_path / "eval", [f"ckpt_path={ckpt}", "data=imagefolder", f"data.root={root}",
                                       "data.labels=labels.csv", "data.val_split=0", "data.augment=false",
                                       "trainer.accelerator=cpu", "trainer.precision=32-true",
                                       "+trainer.enable_progress_bar=false"], config_name="eval")
    evaluate(cfg)
    report = Path(cfg.paths.output_dir) / "report"
    text = (report / "report.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    assert linked == ["pr_curves.png", "co_occurrence.png", "label_errors.png"]
    c = len(NAMES) - 1
    sizes = {"pr_curves.png": PR_SIZE, "co_occurrence.png": co_occurrence_size(c),
             "label_errors.png": label_errors_size(8, 8)}  # 6 images x 3 classes: 8 absent, 10 present labels
    for name in linked:
        with Image.open(report / name) as im:
            assert im.size == tuple(round(DPI * s) for s in sizes[name]), name
    assert "[co_occurrence.csv](co_occurrence.csv)" in text
    truth = read_co_occurrence(report / "co_occurrence.csv")["true"]
    assert np.diag(truth).tolist() == [3, 4, 3]  # cat, dog, owl on 3, 4, 3 of the 6 test images
    assert truth.tolist() == [[3, 2, 1], [2, 4, 2], [1, 2, 3]]

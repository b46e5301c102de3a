"""Multi-label pieces without training: losses against timm and the ASL formula, metrics against
sklearn, the labels-file checks, and the config refusals made before data loads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.metrics import average_precision_score, f1_score, precision_score, recall_score
from timm.loss import BinaryCrossEntropy

from vitpipe.config.preflight import check_config
from vitpipe.data import ImageFolderDataModule
from vitpipe.data.multilabel import LabelsFile, balanced_pos_weight
from vitpipe.errors import ConfigError
from vitpipe.kinds.losses import asl_loss, bce_loss
from vitpipe.metrics.multilabel import MultilabelScores


@pytest.fixture(autouse=True)
def decode_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ---- losses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_bce_with_smoothing_equals_timm_binary_cross_entropy(smoothing):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g) * 3
    target = (torch.rand(6, 5, generator=g) < 0.4).float()
    pos_weight = torch.rand(5, generator=g) * 3 + 0.1
    ours = bce_loss(logits, target, smoothing=smoothing, pos_weight=pos_weight)
    timm = BinaryCrossEntropy(smoothing=smoothing, smooth_dense=True, pos_weight=pos_weight)(logits, target)
    assert torch.allclose(ours, timm, atol=1e-7, rtol=0), (ours, timm)
    if smoothing:  # and the smoothing does something
        assert not torch.allclose(ours, bce_loss(logits, target, pos_weight=pos_weight))


def test_asl_equals_the_papers_formula_on_a_hand_computed_case():
    # two entries: a positive at logit 0 (p = 0.5), a negative at logit ln 3 (p = 0.75)
    logits, target = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[1.0, 0.0]])
    gp, gn, m = 1.0, 4.0, 0.05
    # Ridnik et al. 2021 eq. 7: L+ = (1 - p)^g+ log p; L- = p_m^g- log(1 - p_m), p_m = max(p - m, 0)
    pos = (1 - 0.5) ** gp * math.log(0.5)  # = 0.5 * ln 0.5
    p_m = 0.75 - m  # 0.70
    neg = p_m**gn * math.log(1 - p_m)  # 0.7^4 * ln 0.3
    expected = -(pos + neg) / 2  # mean over the two entries
    got = asl_loss(logits, target, gamma_pos=gp, gamma_neg=gn, clip=m)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.5 * (0.5 * math.log(2) + 0.2401 * -math.log(0.3)), abs=1e-12)


def test_asl_without_focusing_or_margin_is_bce():
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(4, 7, generator=g), (torch.rand(4, 7, generator=g) < 0.3).float()
    assert torch.allclose(asl_loss(logits, target, gamma_pos=0, gamma_neg=0, clip=0), bce_loss(logits, target),
                          atol=1e-6)


def test_asl_margin_drops_easy_negatives():
    # a negative with p = 0.03 < clip contributes nothing at all
    assert asl_loss(torch.tensor([[math.log(0.03 / 0.97)]]), torch.tensor([[0.0]]), clip=0.05).item() == 0.0


def test_balanced_pos_weight_is_negatives_over_positives():
    t = torch.tensor([[1.0, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert torch.allclose(balanced_pos_weight(t), torch.tensor([1 / 3, 3.0, 1.0]))  # class 2: no positives -> 1


# ---- metrics -----------------------------------------------------------------------------------


def test_metrics_equal_sklearn_over_batches():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(70, 6, generator=g) * 2
    target = (torch.rand(70, 6, generator=g) < 0.35).long()
    target[0] = 1  # every class has positives
    m = MultilabelScores(6)
    for lo, hi in ((0, 25), (25, 64), (64, 70)):
        m.update(logits[lo:hi], target[lo:hi].float())
    s = m.compute()
    y, p = target.numpy(), torch.sigmoid(logits).numpy()
    pred = (p >= 0.5).astype(int)
    np.testing.assert_allclose(s["ap"].numpy(), average_precision_score(y, p, average=None), atol=1e-6)
    assert s["map"].item() == pytest.approx(average_precision_score(y, p, average="macro"), abs=1e-6)
    assert s["map_micro"].item() == pytest.approx(average_precision_score(y, p, average="micro"), abs=1e-6)
    for avg in ("macro", "micro"):
        assert s[f"f1_{avg}"].item() == pytest.approx(f1_score(y, pred, average=avg, zero_division=0), abs=1e-6)
        assert s[f"precision_{avg}"].item() == pytest.approx(precision_score(y, pred, average=avg, zero_division=0),
                                                              abs=1e-6)
        assert s[f"recall_{avg}"].item() == pytest.approx(recall_score(y, pred, average=avg, zero_division=0), abs=1e-6)
    assert s["f1_example"].item() == pytest.approx(f1_score(y, pred, average="samples", zero_division=0), abs=1e-6)


# ---- labels files ------------------------------------------------------------------------------


def write_png(path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)


@pytest.fixture
def root(tmp_path):
    """img/0..5.png; labels.csv: 4 train rows, 1 val row, 1 test row, classes cat, dog, owl."""
    root = tmp_path / "imgs"
    for i in range(6):
        write_png(root / "img" / f"{i}.png", 30 * i)
    return root


GOOD = ["img/0.png,cat;dog,train", "img/1.png,dog,train", "img/2.png,owl|cat,train", "img/3.png,owl,",
        "img/4.png,cat,val", "img/5.png,dog;owl,test"]


def write_labels(root, rows, header="path,labels,split", name="labels.csv"):
    (root / name).write_text("\n".join([header, *rows]) + "\n")


def module(root, **kw) -> ImageFolderDataModule:
    args = dict(img_size=8, in_chans=3, num_classes=None, channels=3, root=str(root), labels="labels.csv",
                batch_size=2, val_split=0, augment=False, num_workers=0)
    return ImageFolderDataModule(**(args | kw))


def test_labels_file_gives_multi_hot_targets_and_its_splits(root):
    write_labels(root, GOOD)
    dm = module(root)
    dm.setup("fit")
    dm.setup("test")
    assert dm.num_classes == 3 and dm.class_names == ["cat", "dog", "owl"] and dm.multilabel
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 8, 8) and y.dtype == torch.float32 and y.shape == (2, 3)
    assert dm.data_train.base.targets.tolist() == [[1, 1, 0], [0, 1, 0], [1, 0, 1], [0, 0, 1]]  # file order
    assert dm.data_val.base.targets.tolist() == [[1, 0, 0]] and dm.data_test.base.targets.tolist() == [[0, 1, 1]]


def test_one_column_per_class_layout(root):
    write_labels(root, ["img/0.png,1,0,1", "img/1.png,0,1,0", "img/2.png,0,0,1"], header="path,zebra,ant,bee")
    table = LabelsFile.read(str(root / "labels.csv"))
    assert table.class_names == ("zebra", "ant", "bee")  # file order
    assert table.targets(table.split_rows("train")).tolist() == [[1, 0, 1], [0, 1, 0], [0, 0, 1]]
    write_labels(root, ["img/0.png,1,2"], header="path,zebra,ant")
    with pytest.raises(ConfigError, match=r"line 2: column ant holds '2'; class columns hold 0 or 1"):
        LabelsFile.read(str(root / "labels.csv"))


def test_without_a_split_column_val_and_test_are_carved_seeded(root):
    write_labels(root, [r.rsplit(",", 1)[0] for r in GOOD], header="path,labels")
    dm = module(root, val_split=1, test_split=1)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (4, 1, 1)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_missing_image_is_named_in_one_line(root):
    write_labels(root, [*GOOD, "img/gone.png,cat,train", "img/also.png,dog,train"])
    with pytest.raises(ConfigError) as err:
        module(root).setup("fit")
    assert "2 images named in" in one_line(err) and "line 8 img/gone.png, line 9 img/also.png" in str(err.value)


def test_missing_image_is_a_counted_skip_with_on_bad_image_skip(root):
    write_labels(root, [*GOOD, "img/gone.png,cat,train"])
    dm = module(root, on_bad_image="skip")
    with pytest.warns(UserWarning, match=r"skipped 1 missing images .* line 8 img/gone.png"):
        dm.setup("fit")
    assert len(dm.data_train) == 4


def test_unknown_class_is_named_in_one_line(root):
    write_labels(root, [*GOOD[:5], "img/5.png,dog;yak,test"])
    with pytest.raises(ConfigError) as err:
        module(root)
    assert "line 7 (test) names class 'yak', which no training row has (3 classes: cat, dog, owl)" in one_line(err)


def test_empty_row_is_an_error_with_on_empty_labels_error(root):
    write_labels(root, [*GOOD, "img/5.png,,train"][:5] + ["img/5.png,,train"])
    with pytest.raises(ConfigError) as err:
        module(root, on_empty_labels="error").setup("fit")
    assert "1 rows of" in one_line(err) and "name no label: line 7 img/5.png" in str(err.value)


def test_empty_row_is_a_counted_skip_or_kept_all_negative(root, capsys):
    write_labels(root, GOOD[:5] + ["img/5.png,,train"])
    dm = module(root, on_empty_labels="skip")
    with pytest.warns(UserWarning, match=r"skipped 1 rows of .* without labels, e\.g\. line 7 img/5.png"):
        dm.setup("fit")
    assert len(dm.data_train) == 4
    kept = module(root)  # default: keep
    kept.setup("fit")
    assert len(kept.data_train) == 5 and kept.data_train.base.targets[-1].tolist() == [0, 0, 0]
    assert "1 of the 5 train images" in capsys.readouterr().err


def test_unreadable_image_is_named(root):
    (root / "img" / "3.png").write_bytes(b"not a png")
    write_labels(root, GOOD)
    with pytest.raises(ConfigError, match=r"1 unreadable images named in .*img/3.png"):
        module(root).setup("fit")


@pytest.mark.parametrize("rows, match", [
    (["img/0.png,cat,train", "img/0.png,dog,train"], r"line 3 names img/0.png again \(first on line 2\)"),
    (["../x.png,cat,train"], r"line 2: path '../x.png' leaves data.root"),
    (["img/0.png,cat,tran"], r"line 2: split='tran'; valid: train, val, test"),
    ([",cat,train"], r"line 2 has no path"),
])  # fmt: skip
def test_bad_rows_are_named_by_line(root, rows, match):
    write_labels(root, rows)
    with pytest.raises(ConfigError, match=match):
        module(root)


# ---- config refusals before data loads ---------------------------------------------------------


def test_multilabel_refusals_before_data_loads(cfg_factory, tmp_path):
    base = ["data=imagefolder", f"data.root={tmp_path / 'nowhere'}", "data.labels=labels.csv", "data.num_classes=3",
            "debug=fast"]
    for extra, match in (
        ([], r"data.labels=labels.csv gives each image a set of labels; set module.task=multilabel"),
        (["module.task=multilabel", "module.distill.teacher=x.ckpt"], r"cannot take module.distill.teacher=x.ckpt"),
        (["module.task=multilabel", "data.sampler=balanced"], r"cannot take data.sampler=balanced"),
        (["module.task=multilabel", "data.naflex.enabled=true"], r"cannot take data.naflex.enabled=True"),
    ):
        with pytest.raises(ConfigError, match=match):
            check_config(cfg_factory(*base, *extra))
    with pytest.raises(ConfigError, match=r"module.task=multilabel needs label sets: data=imagefolder data.labels="):
        check_config(cfg_factory("data=shards", f"data.root={tmp_path}", "data.num_classes=3", "data.channels=3",
                                 "module.task=multilabel", "debug=fast"))  # both given: no index is read for them


def test_multilabel_monitors_val_map(cfg_factory, tmp_path):
    cfg = cfg_factory("module.task=multilabel", "callbacks=early_stopping")
    assert cfg.callbacks.model_checkpoint.monitor == "val/map" == cfg.callbacks.early_stopping.monitor
    assert cfg_factory().callbacks.model_checkpoint.monitor == "val/acc"


def test_module_refuses_bad_task_and_loss():
    from vitpipe import create_model
    from vitpipe.lit import ImageClassifier

    net = create_model("vit_nano", img_size=8, patch_size=4, num_classes=3, dim=16, depth=1, num_heads=2)
    opt = torch.optim.AdamW
    with pytest.raises(ConfigError, match=r"module.task='multi'; valid choices: multiclass, multilabel"):
        ImageClassifier(net, opt, task="multi")
    with pytest.raises(ConfigError, match=r"module.loss='asl' is a multi-label loss"):
        ImageClassifier(net, opt, loss="asl")
    with pytest.raises(ConfigError, match=r"module.loss='focal'; valid choices: bce, asl"):
        ImageClassifier(net, opt, task="multilabel", loss="focal")
    with pytest.raises(ConfigError, match=r"module.asl.gamma is not a setting; valid: gamma_neg, gamma_pos, clip"):
        ImageClassifier(net, opt, task="multilabel", loss="asl", asl={"gamma": 1})


def test_module_mixup_mixes_multi_hot_targets_by_the_images_lambda():
    from vitpipe import create_model
    from vitpipe.lit import ImageClassifier

    net = create_model("vit_nano", img_size=8, patch_size=4, num_classes=3, dim=16, depth=1, num_heads=2)
    module = ImageClassifier(net, torch.optim.AdamW, task="multilabel", mixup={"mixup_alpha": 1.0},
                             label_smoothing=0.2)
    torch.manual_seed(0)
    x = torch.rand(4, 3, 8, 8)
    y = torch.tensor([[1.0, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1]])
    mixed, soft = module.mixup(x.clone(), y)
    lam = ((mixed - x.flip(0)) / (x - x.flip(0)))[0, 0, 0, 0].item()  # from the pixels: lam x + (1 - lam) x'
    assert 0 < lam < 1 and torch.allclose(mixed, lam * x + (1 - lam) * x.flip(0), atol=1e-5)
    smooth = y * 0.8 + 0.1  # timm's dense smoothing towards 0.5, before mixing
    assert torch.allclose(soft, lam * smooth + (1 - lam) * smooth.flip(0), atol=1e-5)

"""The training pipeline: config groups, runs on real data, resume, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import open_dict

from vitpipe.config.build import build_trainer
from vitpipe.errors import ConfigError
from vitpipe.run.build import build_from_config
from vitpipe.tasks.train import train

ROOT = Path(__file__).resolve().parents[1]
GROUP = lambda g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml"))  # noqa: E731
CLASSIFIER_MODELS = [m for m in GROUP("model") if m.startswith("vit_")]


@pytest.mark.parametrize("model", CLASSIFIER_MODELS)
def test_every_model_config_instantiates(cfg_factory, model):
    cfg = cfg_factory(f"model={model}", "debug=fast")
    net = instantiate(cfg.model)
    size = net.img_size
    with torch.no_grad():
        assert net(torch.randn(1, 1, *size)).shape == (1, 10)  # digits: 1 channel, 10 classes


@pytest.mark.parametrize("data", ["digits", "fashion_mnist", "cifar10", "cifar100", "imagefolder", "synthetic"])
def test_every_data_config_instantiates(cfg_factory, tmp_path, data):
    extra = [f"data.root={tmp_path}", "data.num_classes=3"] if data == "imagefolder" else []
    cfg = cfg_factory(f"data={data}", "debug=fast", *extra)
    dm = instantiate(cfg.data)
    assert dm.num_classes == cfg.data.num_classes and dm.channels == cfg.model.in_chans


@pytest.mark.parametrize("group", ["trainer", "logger", "callbacks", "module"])
def test_every_other_group_option_instantiates(cfg_factory, group):
    for option in GROUP(group):
        if group == "module" and option != "classifier":
            continue  # the captioning module needs a captioner net (tests/test_captioner.py)
        cfg = cfg_factory(f"{group}={option}", "debug=fast")
        if group == "trainer":
            if option in ("gpu", "ddp", "fsdp") and not torch.cuda.is_available():
                continue  # GPU-only trainers (their composition is covered by test_scale)
            node = cfg.trainer
            assert isinstance(build_trainer(node, logger=False), __import__("lightning").Trainer)
        elif group == "module":
            _, net, module = build_from_config(cfg)
            assert module.net is net
        else:
            for key, node in (cfg.get(group) or {}).items():
                assert instantiate(node) is not None, f"{group}={option}: {key}"


def test_several_loggers_at_once(cfg_factory):
    cfg = cfg_factory("logger=[csv,tensorboard]", "debug=fast")
    assert set(cfg.logger) == {"csv", "tensorboard"}


def test_runs_without_any_logger(cfg_factory):
    # the default callbacks include a LearningRateMonitor, which Lightning refuses without a logger
    cfg = cfg_factory("logger=none", "debug=fast")
    assert "lr_monitor" in cfg.callbacks
    assert "test/acc" in train(cfg)


def test_default_config_fast_dev_run(cfg_factory):
    cfg = cfg_factory("debug=default")
    metrics = train(cfg)
    assert {"test/acc", "test/loss", "val/acc"} <= set(metrics)
    assert json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())["test/acc"] == metrics["test/acc"]
    assert (Path(cfg.paths.output_dir) / "config.yaml").is_file()


def test_two_epochs_on_digits_beat_chance_by_far(cfg_factory):
    # 4-px patches (a 2x2 grid) and no augmentation: a ViT that learns within 2 epochs (82 steps)
    cfg = cfg_factory("trainer.max_epochs=2", "trainer.accelerator=cpu", "model.patch_size=4", "data.augment=false")
    metrics = train(cfg)
    print(f"digits, 2 epochs: test/acc={metrics['test/acc']:.3f}")
    assert metrics["test/acc"] > 0.5  # chance is 0.1
    assert 0 <= metrics["val/acc_best"] <= 1 and metrics["val/acc_best"] >= metrics.get("val/acc", 0) - 1e-6


def _short(cfg_factory, sub, *extra):
    return cfg_factory("debug=fast", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
                       "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0",
                       *extra, sub=sub)


def test_resume_continues_at_the_saved_step(cfg_factory):
    first = _short(cfg_factory, "a", "trainer.max_epochs=1", "test=false")
    train(first)
    last = Path(first.paths.output_dir) / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 3

    resumed = _short(cfg_factory, "b", "trainer.max_epochs=2", "test=false", f"ckpt_path={last}")
    with open_dict(resumed):
        resumed.paths.log_dir = first.paths.log_dir
    train(resumed)
    ckpt2 = torch.load(Path(resumed.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt2["global_step"] == 6 and ckpt2["epoch"] == ckpt["epoch"] + 1
    import csv

    rows = list(csv.DictReader((Path(resumed.paths.output_dir) / "csv" / "metrics.csv").read_text().splitlines()))
    steps = [int(r["step"]) for r in rows if r.get("train/loss_step")]
    assert steps and min(steps) >= 3  # it continued at step 3; a fresh start would log steps 0-2 again
    adam_steps = {float(s["step"]) for s in ckpt2["optimizer_states"][0]["state"].values()}
    assert adam_steps == {6.0}  # AdamW's moments were restored and continued, not restarted

    # a directory resolves to its newest last.ckpt: the resumed run's (`last` is covered in test_scale)
    from vitpipe.run.paths import resolve_ckpt_path

    root = Path(first.paths.output_dir).parents[1]
    assert resolve_ckpt_path(str(root), which="last").parent.parent == Path(resumed.paths.output_dir)


# ---- bad input: one clear error, before data loads -------------------------------------------------


def test_num_classes_mismatch(cfg_factory):
    with pytest.raises(ConfigError, match=r"model.num_classes=7 does not match data.num_classes=10"):
        build_from_config(cfg_factory("model.num_classes=7"))


def test_unresolvable_model_data_size(cfg_factory):
    with pytest.raises(ConfigError, match=r"30x30.*patch size 4x4"):
        build_from_config(cfg_factory("model=vit_micro", "model.img_size=30"))
    with pytest.raises(ConfigError, match=r"in_chans=2"):
        build_from_config(cfg_factory("model.in_chans=2"))


def test_missing_dataset_offline_says_how_to_get_it(cfg_factory):
    with pytest.raises(ConfigError, match=r"download"):
        # download=true (the default) finds out in prepare_data
        build_from_config(cfg_factory("data=cifar10", "data.download=false"))


def test_bad_checkpoints(cfg_factory, tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"cannot read checkpoint .*garbage.ckpt"):
        train(cfg_factory(f"ckpt_path={garbage}"))
    with pytest.raises(ConfigError, match=r"no such file"):
        train(cfg_factory(f"ckpt_path={tmp_path / 'missing.ckpt'}"))
    other = _short(cfg_factory, "small", "trainer.max_epochs=1", "test=false", "model.dim=16")
    train(other)
    wrong = Path(other.paths.output_dir) / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError, match=r"does not fit the configured model"):
        train(cfg_factory("debug=fast", f"ckpt_path={wrong}"))


def test_corrupt_image_in_image_folder(cfg_factory, tmp_path):
    from PIL import Image

    for c in ("a", "b"):
        (tmp_path / "imgs" / "train" / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (12, 12), (i * 40, 0, 0)).save(tmp_path / "imgs" / "train" / c / f"{i}.png")
    (tmp_path / "imgs" / "train" / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    cfg = cfg_factory("data=imagefolder", f"data.root={tmp_path / 'imgs'}", "data.num_classes=2", "debug=fast",
                      "data.num_workers=0")
    with pytest.raises(ConfigError, match="broken.png"):
        train(cfg)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow  # 17-25 s of subprocesses: .ci/run runs it after the default suite
def test_cli_config_mistakes_print_one_line_without_traceback(tmp_path):
    r = _cli("model=vit_x99", f"paths.log_dir={tmp_path}")
    assert r.returncode == 2 and r.stderr.strip().startswith("vitpipe: error: model=vit_x99 is not an option of "
                                                            "model (valid: captioner, mae, mae_vit_b16, ")
    assert "timm, vit and " in r.stderr  # vit: the base (with model.name=)
    r = _cli("model.num_classes=3", f"paths.log_dir={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.num_classes=3 does not match data.num_classes=10" in r.stderr


def test_vit_b16_on_synthetic_runs_at_224(cfg_factory):
    cfg = cfg_factory("model=vit_b16", "data=synthetic", "trainer.fast_dev_run=true", "trainer.accelerator=cpu",
                      "data.batch_size=2", "data.eval_batch_size=2", "data.length=8", "data.test_length=4")
    dm, net, module = build_from_config(cfg)
    seen = []
    net.register_forward_pre_hook(lambda m, a: seen.append(tuple(a[0].shape)))
    build_trainer(cfg.trainer, logger=False, enable_checkpointing=False).fit(module, dm)
    assert seen and all(s[-2:] == (224, 224) and s[1] == 3 for s in seen)


def test_eval_script_reproduces_the_test_metrics_from_the_checkpoint_alone(cfg_factory, tmp_path):
    from vitpipe.tasks.evaluate import evaluate

    cfg = cfg_factory("debug=fast", "trainer.limit_test_batches=null", sub="train")
    metrics = train(cfg)
    best = Path(cfg.paths.output_dir) / "checkpoints"
    ckpt = next(p for p in best.glob("epoch_*.ckpt"))
    ecfg = cfg_factory(f"ckpt_path={ckpt}", "trainer.accelerator=cpu", "trainer.precision=32-true",
                       config_name="eval", sub="eval")
    scores = evaluate(ecfg)
    assert scores["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert json.loads((Path(ecfg.paths.output_dir) / "metrics.json").read_text())["test/acc"] == scores["test/acc"]
    with pytest.raises(ConfigError, match="no such file"):
        evaluate(cfg_factory(f"ckpt_path={tmp_path / 'nope.ckpt'}", config_name="eval", sub="bad"))


class SeenByTrainingStep(__import__("lightning").Callback):
    """Each training batch as it reached the step, the network's input, output and the gradient of
    the loss on that output, and the loss."""

    def __init__(self, net) -> None:
        self.batches, self.inputs, self.logits, self.grads, self.losses = [], [], [], [], []
        net.register_forward_hook(self._record)

    def _record(self, net, args, out) -> None:
        if net.training:  # not validation
            self.inputs.append(args[0].detach().clone())
            self.logits.append(out.detach().clone())
            out.register_hook(lambda g: self.grads.append(g.detach().clone()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append([t.clone() for t in batch])  # timm's Mixup mixes the batch in place

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].detach())


@pytest.mark.parametrize("mixup", ["{mixup_alpha: 0.8, cutmix_alpha: 0.0}", "{mixup_alpha: 0.0, cutmix_alpha: 1.0}"],
                         ids=["mixup", "cutmix"])
def test_training_step_sees_mixed_images_and_soft_targets(cfg_factory, mixup):
    """The network gets each image mixed with its partner in the flipped batch (timm's batch mode):
    a convex combination (mixup) or the partner's box pasted in (cutmix), and the loss is the
    cross-entropy against the same mix of the two smoothed one-hot targets, lam by the mixed area.
    The targets the loss used are read back from its gradient: d mean-CE / d logits = (softmax - t) / B."""
    import lightning as L
    import torch.nn.functional as F

    cfg = cfg_factory("debug=fast", "data=synthetic", "data.augment=false", "data.batch_size=8",
                      "trainer.limit_train_batches=3", "test=false", "module.label_smoothing=0.1",
                      f"+module.mixup={mixup}")
    L.seed_everything(cfg.seed)
    dm, net, module = build_from_config(cfg)
    seen = SeenByTrainingStep(net)
    build_trainer(cfg.trainer, logger=False, enable_checkpointing=False, callbacks=[seen]).fit(module, dm)
    assert len(seen.batches) == len(seen.inputs) == len(seen.grads) == len(seen.losses) == 3
    n, smoothing = cfg.data.num_classes, 0.1
    for (x, y), mixed, logits, grad, loss in zip(seen.batches, seen.inputs, seen.logits, seen.grads, seen.losses):
        partner = x.flip(0)
        assert (mixed - x).abs().max() > 1e-3, "the network saw the images unmixed"
        if "cutmix_alpha: 0.0" in mixup:  # mixed = lam * x + (1 - lam) * partner, one lam per batch
            d = x - partner
            lam = float(((mixed - partner) * d).sum() / (d * d).sum())
            torch.testing.assert_close(mixed, lam * x + (1 - lam) * partner, rtol=0, atol=1e-5)
        else:  # one box, the same for the whole batch, holds the partner's pixels; the rest is the image's
            box = (mixed != x).any(0).any(0)  # (H, W)
            rows, cols = box.any(1).nonzero().flatten(), box.any(0).nonzero().flatten()
            r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
            assert box[r0:r1, c0:c1].all() and box.sum() == (r1 - r0) * (c1 - c0), "not one rectangle"
            expected = x.clone()
            expected[..., r0:r1, c0:c1] = partner[..., r0:r1, c0:c1]
            assert torch.equal(mixed, expected)
            lam = 1 - (r1 - r0) * (c1 - c0) / box.numel()  # timm's correct_lam: by the pasted area
        assert 0 < lam < 1
        off = smoothing / n
        one_hot = torch.full((len(y), n), off).scatter_(1, y[:, None], 1 - smoothing + off)
        soft = lam * one_hot + (1 - lam) * one_hot.flip(0)
        used = logits.softmax(-1) - len(y) * grad  # (B, C): the targets of the loss
        torch.testing.assert_close(used, soft, rtol=0, atol=1e-5)
        assert (used.max(1).values < 1 - smoothing).any()  # not (smoothed) one-hot
        torch.testing.assert_close(loss, F.cross_entropy(logits, soft), rtol=1e-5, atol=1e-6)


def test_wandb_offline_run_is_written_and_closed(cfg_factory, wandb_offline):
    wandb = pytest.importorskip("wandb")
    cfg = cfg_factory("debug=fast", "logger=[csv,wandb]", "test=false", "trainer.limit_train_batches=2")
    train(cfg)
    assert wandb.run is None  # finished, so the next job of a sweep starts its own run
    runs = list((Path(cfg.paths.output_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))

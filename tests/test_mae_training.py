"""MAE pre-training (module=mae, model=mae_vit_*): it learns, its optimizer is the paper's, a stopped run
resumes bit for bit, unlabeled image folders train, the MAE augmentation on both input paths, and the
command composes and runs as typed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from omegaconf import open_dict
from PIL import Image
from test_scale import _last, _net  # the resume tests' readers

from vitpipe.config.build import apply_lr_scaling
from vitpipe.errors import ConfigError
from vitpipe.lit.mae import MAEModule
from vitpipe.lit.optim import build_optimizer
from vitpipe.run.build import build_from_config
from vitpipe.tasks.cli import run_cli
from vitpipe.tasks.train import train

ROOT = Path(__file__).resolve().parents[1]
MAE = ["model=mae_vit_nano", "module=mae"]
# debug=fast shrinks the encoder through model.dim (create_mae takes it as the embed_dim)
TINY = [*MAE, "debug=fast", "logger=none", "callbacks.progress_bar.refresh_rate=1000"]


def _fixed_batch(dm) -> torch.Tensor:
    dm.setup("fit")
    x, _ = next(iter(dm.val_dataloader()))
    return dm.on_after_batch_transfer((x, None), 0)[0] if dm.fast_path else x


def _loss(module: MAEModule, imgs: torch.Tensor) -> float:
    module.eval()
    with torch.no_grad():
        return float(module(imgs, noise=module.eval_noise(imgs, 0))[0])


def test_a_tiny_mae_lowers_its_reconstruction_loss_on_a_fixed_batch(cfg_factory):
    """60 steps at lr 2e-3 (no lr scaling): the loss on fixed held-out images under fixed masks
    falls to below 70% of the untrained network's (measured: 1.45 -> 0.73)."""
    cfg = cfg_factory(*TINY, "lr_scaling.rule=none", "module.optimizer.lr=2e-3", "trainer.limit_train_batches=30",
                      "trainer.max_epochs=2", "trainer.limit_val_batches=1", "test=false")
    run_dir = Path(cfg.paths.output_dir)
    L.seed_everything(cfg.seed)
    dm, _, untrained = build_from_config(cfg)
    imgs = _fixed_batch(dm)
    before = _loss(untrained, imgs)
    metrics = train(cfg)
    assert {"train/loss", "val/loss", "val/loss_best"} <= set(metrics) and "val/acc" not in metrics
    trained = untrained
    trained.load_state_dict(_last(run_dir)["state_dict"])
    after = _loss(trained, imgs)
    assert after < 0.7 * before, (before, after)
    # the fixed evaluation masks: the same loss twice, another seed another loss
    assert _loss(trained, imgs) == after
    trained.hparams.eval_seed = 1
    assert _loss(trained, imgs) != after


def test_the_optimizer_is_the_papers_adamw_with_decay_on_weights_only(cfg_factory):
    cfg = cfg_factory(*TINY, "model.pos_embed=learned", "model.reg_tokens=1")
    assert cfg.callbacks.model_checkpoint.monitor == "val/loss" and cfg.callbacks.model_checkpoint.mode == "min"
    assert cfg.data.augment == "mae" and cfg.optimized_metric == "val/loss_best"

    class OneDevice:  # what apply_lr_scaling reads from a Trainer
        accumulate_grad_batches, world_size, num_devices, num_nodes, is_global_zero = 1, 1, 1, 1, True

    apply_lr_scaling(cfg, OneDevice())
    assert cfg.module.optimizer.lr == pytest.approx(1.5e-4 * cfg.data.batch_size / 256)  # base lr x batch / 256
    _, net, module = build_from_config(cfg)
    opt = build_optimizer(module.optimizer_factory, net)
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)
    assert opt.defaults["lr"] == pytest.approx(cfg.module.optimizer.lr)
    names = {id(p): n for n, p in net.named_parameters()}
    decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert set(decay) == {0.05, 0.0}
    assert {n for n in decay[0.0] if not ("norm" in n or n.endswith(".bias"))} >= {
        "cls_token", "reg_token", "mask_token"}  # fmt: skip
    assert any(n.startswith("pos_embed") for n in decay[0.0])
    assert all(p.ndim >= 2 for n, p in net.named_parameters() if n in decay[0.05])
    assert not any("norm" in n or n.endswith(".bias") or "token" in n or "pos_embed" in n for n in decay[0.05])
    assert decay[0.05] | decay[0.0] == {n for n, p in net.named_parameters() if p.requires_grad}
    assert "decoder_pred.weight" in decay[0.05] and "blocks.0.attn.qkv.weight" in decay[0.05]


def test_mae_refuses_a_bad_mask_ratio_and_an_augmentation_it_does_not_use(cfg_factory):
    with pytest.raises(ConfigError, match=r"module.mask_ratio=1.0: expected a fraction in \[0, 1\)"):
        build_from_config(cfg_factory(*TINY, "module.mask_ratio=1.0"))
    # 0 masks no patch: the loss, a mean over the masked patches, would be 0 / 0 = NaN; 0.99 keeps none
    for ratio, kept in (("0.0", "(\\d+) of the \\1"), ("0.99", "0 of the \\d+")):
        with pytest.raises(ConfigError, match=rf"module.mask_ratio={ratio} keeps {kept} patches: training needs at "
                                              rf"least one masked .* e.g. the paper's 0.75"):
            build_from_config(cfg_factory(*TINY, f"module.mask_ratio={ratio}"))
    with pytest.raises(ConfigError, match="data.augment=mae is RandomResizedCrop \\+ flip alone .*data.random_erasing=0"):
        build_from_config(cfg_factory(*TINY, "data.random_erasing=0.25"))
    with pytest.raises(ConfigError, match=r"data.augment='crop'; valid choices: true, false, mae"):
        build_from_config(cfg_factory(*TINY, "data.augment=crop"))


def test_a_sigterm_mid_epoch_resumes_with_ckpt_path_last_to_the_uninterrupted_weights(cfg_factory, tmp_path):
    """2 epochs of 4 steps, stopped by SIGTERM after step 5 (mid-epoch 1) and resumed with ckpt_path=last:
    the final weights equal an uninterrupted run's bit for bit. The run draws the masks (torch's global
    generator), drop path (depth 2) and the random resized crops (the data's resume generator)."""
    common = [*TINY, "trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
              "test=false", "trainer.deterministic=true", "model.depth=2", "model.drop_path_rate=0.1",
              "data.hflip=true", "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=0"]
    full = cfg_factory(*common, sub="full")
    full_dir = Path(full.paths.output_dir)
    train(full)
    final = _last(full_dir)
    assert final["global_step"] == 8

    logs = tmp_path / "logs"
    stopped = cfg_factory(*common, "+callbacks.kill._target_=fault_injection.SignalAtStep", "+callbacks.kill.step=5",
                          sub="logs/debug/runs/stopped")  # inside the log dir, where ckpt_path=last looks
    with open_dict(stopped):
        stopped.paths.log_dir = str(logs)
    with pytest.raises(SystemExit) as stop:
        run_cli(train, stopped)
    assert stop.value.code == 128 + signal.SIGTERM
    saved = _last(Path(stopped.paths.output_dir))
    assert saved["global_step"] == 5 and saved["epoch"] == 1
    assert _net(saved).keys() == _net(final).keys() and any(not torch.equal(_net(saved)[k], v)
                                                            for k, v in _net(final).items())

    resumed = cfg_factory(*common, "ckpt_path=last", sub="resumed")
    with open_dict(resumed):
        resumed.paths.log_dir = str(logs)
    resumed_dir = Path(resumed.paths.output_dir)
    train(resumed)
    after = _last(resumed_dir)
    assert after["global_step"] == 8
    differ = [k for k, v in _net(final).items() if not torch.equal(v, _net(after)[k])]
    assert differ == []

    # the comparison can fail: the same checkpoint without its random-generator states draws other masks
    bare = tmp_path / "bare.ckpt"
    torch.save({k: v for k, v in saved.items() if k != "rng_states"}, bare)
    fresh = cfg_factory(*common, f"ckpt_path={bare}", sub="fresh")
    fresh_dir = Path(fresh.paths.output_dir)
    train(fresh)
    assert any(not torch.equal(v, _net(_last(fresh_dir))[k]) for k, v in _net(final).items())


def _images(folder: Path, n: int, size=(10, 12), seed=0) -> list[Path]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"img{i:03d}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    return paths


FOLDER = ["data=imagefolder", "data.num_workers=0", "data.batch_size=8", "data.eval_batch_size=8",
          "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]


def test_an_unlabeled_image_folder_pre_trains(cfg_factory, tmp_path):
    """data.labels=none: every image under root (flat and nested, names such as train/ mean nothing), the
    non-image and unreadable files left out, one class; val and test carved from the whole set."""
    root = tmp_path / "photos"
    images = [*_images(root, 20), *_images(root / "2024" / "may", 10, seed=1), *_images(root / "train", 10, seed=2)]
    (root / "notes.txt").write_text("not an image")
    (root / "broken.png").write_bytes(b"")
    cfg = cfg_factory(*TINY, *FOLDER, f"data.root={root}", "data.labels=none", "data.on_bad_image=skip",
                      "data.val_split=0.2", "data.test_split=0.1")
    dm, _, _ = build_from_config(cfg)
    assert cfg.data.num_classes == dm.num_classes == 1  # filled in by the config check: one dummy class
    dm.setup("fit")
    dm.setup("test")
    assert len(dm.data_train) + len(dm.data_val) + len(dm.data_test) == len(images) == 40
    assert (len(dm.data_val), len(dm.data_test)) == (7, 4) and dm.class_names == ["unlabeled"]
    assert {label for _, label in dm.data_train.base.samples} == {0}
    metrics = train(cfg)
    assert np.isfinite(metrics["val/loss"]) and np.isfinite(metrics["test/loss"])
    assert not (Path(cfg.paths.output_dir) / "predictions.csv").exists()  # no classifier: no report

    with pytest.raises(ConfigError, match="data.num_classes=3 but data.labels=none gives one class"):
        build_from_config(cfg_factory(*TINY, *FOLDER, f"data.root={root}", "data.labels=none", "data.num_classes=3"))
    with pytest.raises(ConfigError, match=r"data.labels='flat'; valid choices: folders"):
        build_from_config(cfg_factory(*TINY, *FOLDER, f"data.root={root}", "data.labels=flat"))
    # a classifier would fit the one dummy class (100% accuracy): refused before anything is built
    with pytest.raises(ConfigError, match=r"data.labels=none reads the images without labels \(one class\), which "
                                          r"module ImageClassifier cannot learn from; pre-train on them with module=mae"):
        build_from_config(cfg_factory("debug=fast", *FOLDER, f"data.root={root}", "data.labels=none"))


def test_a_labeled_image_folder_pre_trains_with_its_labels_ignored(cfg_factory, tmp_path):
    root = tmp_path / "classes"
    for i, c in enumerate(("cat", "dog")):
        _images(root / "train" / c, 12, seed=i)
    metrics = train(cfg_factory(*TINY, *FOLDER, f"data.root={root}", "data.test_split=0.2"))
    assert np.isfinite(metrics["test/loss"]) and "test/acc" not in metrics


def test_the_mae_crop_is_torchvisions_random_resized_crop_on_both_paths():
    from torchvision.transforms import v2

    from vitpipe.data.fast import random_resized_crop, random_resized_crop_boxes
    from vitpipe.data.transforms import standard_transform

    x = torch.rand(64, 1, 28, 28)
    # the whole image at its own ratio: the identity (output pixel centres land on input centres)
    assert torch.allclose(random_resized_crop(x, (28, 28), scale=(1.0, 1.0), ratio=(1.0, 1.0)), x, atol=1e-5)
    gen = torch.Generator().manual_seed(0)
    boxes = random_resized_crop_boxes(20000, (28, 28), (0.2, 1.0), (3 / 4, 4 / 3), gen)  # (N, 4) top, left, h, w
    top, left, h, w = boxes.unbind(1)
    assert bool(((top >= 0) & (left >= 0) & (top + h <= 28) & (left + w <= 28) & (h > 0) & (w > 0)).all())
    frac = (h * w).float() / 784
    assert float(frac.min()) > 0.19 and float(frac.max()) <= 1.0
    # the same box distribution as torchvision's get_params (mean area, mean offset), within sampling error
    torch.manual_seed(0)
    ref = torch.tensor([v2.RandomResizedCrop.get_params(torch.zeros(1, 28, 28), [0.2, 1.0], [3 / 4, 4 / 3])
                        for _ in range(20000)])  # fmt: skip
    assert abs(float(frac.mean()) - float((ref[:, 2] * ref[:, 3]).float().mean() / 784)) < 0.01
    assert abs(float(top.float().mean()) - float(ref[:, 0].float().mean())) < 0.15
    # the standard path: crop resized to the model's size, normalised, no other op
    t = standard_transform(train=True, native_size=(28, 28), img_size=(16, 16), mean=(0.5,), std=(0.5,), channels=1,
                           in_chans=1, augment="mae", random_erasing=0.0)
    names = [type(op).__name__ for op in t.transforms]
    assert names == ["ToImage", "ToDtype", "RandomResizedCrop", "RandomHorizontalFlip", "Normalize"]
    assert t.transforms[2].scale == (0.2, 1.0)
    out = t(Image.fromarray(np.zeros((28, 28), np.uint8)))
    assert out.shape == (1, 16, 16) and torch.allclose(out, torch.full_like(out, -1.0))


def test_the_fast_path_mae_augmentation_crops_to_the_model_size(cfg_factory):
    cfg = cfg_factory(*TINY, "data.hflip=true", "model.img_size=16", "model.patch_size=4")
    dm, _, _ = build_from_config(cfg)
    dm.setup("fit")
    x, _ = next(iter(dm.train_dataloader()))  # uint8 (B, 1, 8, 8)
    torch.manual_seed(0)
    a = dm.augment_batch(x, train=True)
    b = dm.augment_batch(x, train=True)
    ev = dm.augment_batch(x, train=False)
    assert a.shape == ev.shape == (len(x), 1, 16, 16) and not torch.equal(a, b)  # random, per call
    assert torch.equal(ev, dm.augment_batch(x, train=False))  # evaluation: resized only


def _cli(*args, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow  # 17-25 s of subprocesses: .ci/run runs it after the default suite
def test_the_mae_command_composes_and_its_debug_run_trains(tmp_path):
    shown = _cli(*MAE, "--cfg", "job", "--resolve")
    assert shown.returncode == 0, shown.stderr[-2000:]
    for line in ("_target_: vitpipe.lit.mae.MAEModule", "_target_: vitpipe.models.registry.create_mae",
                 "mask_ratio: 0.75", "monitor: val/loss", "augment: mae", "rule: linear"):
        assert line in shown.stdout, line
    run = _cli(*MAE, "debug=fast", f"hydra.run.dir={tmp_path / 'run'}", f"paths.log_dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "test/loss" in run.stdout and (tmp_path / "run" / "metrics.json").is_file()
    # what people look at: the reconstruction figure (the first epoch and the end) and the loss curves
    report = tmp_path / "run" / "report"
    assert {p.name for p in report.iterdir()} >= {"reconstruction.png", "curves.png", "reconstruction"}
    stored = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert stored["state_dict"]["net.cls_token"].shape[-1] == 32  # debug=fast's width reached the MAE encoder


def test_an_mae_run_fine_tunes_into_a_vit_classifier_with_its_encoder(cfg_factory, tmp_path):
    """model.pretrained=<the MAE run's best checkpoint> into model=vit_nano of the same encoder
    dimensions (debug=fast's 32 wide, 1 deep): every encoder tensor equals the MAE's, the head is new,
    and the classifier trains."""
    mae_cfg = cfg_factory(*TINY, "model.embed_dim=32", "model.pos_embed=learned", sub="mae")
    mae_dir = Path(mae_cfg.paths.output_dir)
    train(mae_cfg)
    best = next((mae_dir / "checkpoints").glob("epoch_*.ckpt"))
    mae_net = _net(torch.load(best, weights_only=True))
    for source in (best, mae_dir):
        cfg = cfg_factory("model=vit_nano", "debug=fast", "logger=none", "model.pos_embed=learned",
                          f"model.pretrained={source}", sub=f"ft_{source.name}")
        _, net, _ = build_from_config(cfg)
        own = net.state_dict()
        encoder = [k for k in own if not k.startswith("head.")]
        assert encoder and all(f"net.{k}" in mae_net for k in encoder), [k for k in encoder if f"net.{k}" not in mae_net]
        assert [k for k in encoder if not torch.equal(own[k], mae_net[f"net.{k}"])] == [], source
        assert "net.decoder_pred.weight" in mae_net and not any(k.startswith("decoder") for k in own)
    metrics = train(cfg)
    assert np.isfinite(metrics["val/loss"]) and "val/acc" in metrics


def test_the_classification_callbacks_leave_an_mae_run_alone(cfg_factory, capsys):
    """callbacks=rollout and the report: an MAE network has no ViT to explain and no logits to report;
    the run trains and tests, says so in one line, and writes neither."""
    cfg = cfg_factory(*TINY, "callbacks=rollout")
    run_dir = Path(cfg.paths.output_dir)
    metrics = train(cfg)
    assert np.isfinite(metrics["test/loss"])
    assert ("vitpipe: note: callbacks.rollout: MaskedAutoencoderViT has no ViT encoder (forward_features) to "
            "explain; no rollout in this run") in capsys.readouterr().out
    assert not (run_dir / "rollout").exists() and not (run_dir / "predictions.csv").exists()
    assert (run_dir / "history.csv").is_file()


def test_the_fashion_mnist_experiment_is_the_mae_recipe_on_28px_images(cfg_factory):
    from vitpipe.config.preflight import check_config

    cfg = cfg_factory("experiment=mae_fmnist")
    check_config(cfg)
    assert cfg.module._target_ == "vitpipe.lit.mae.MAEModule" and cfg.data.augment == "mae"
    assert cfg.callbacks.model_checkpoint.monitor == "val/loss" and cfg.callbacks.model_checkpoint.mode == "min"
    assert (cfg.model.img_size, cfg.model.patch_size, cfg.model.in_chans) == (28, 4, 1)
    assert cfg.data.batch_size == cfg.lr_scaling.base_batch_size == 256  # module.optimizer.lr is the lr used

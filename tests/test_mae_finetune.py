"""MAE fine-tuning protocols (He et al. 2022, Appendix A): module.probe_bn (the linear probe's
BatchNorm1d without affine before the head), its checkpoints and exports, and the two experiments
(experiment=mae_fmnist_finetune, experiment=mae_fmnist_probe) on an MAE run's encoder."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from conftest import make_cfg
from torch import nn

import vitpipe
from vitpipe.config.preflight import check_config
from vitpipe.export.onnx_format import check_onnx
from vitpipe.lit import ImageClassifier
from vitpipe.lit.finetune import ProbeHead, fold_probe_bn
from vitpipe.run.build import build_from_config
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.export import export
from vitpipe.tasks.train import train

QUIET = ["debug=fast", "logger=none", "callbacks.progress_bar.refresh_rate=1000"]
PROBE = [*QUIET, "module.finetune=linear_probe", "module.probe_bn=true", "module.optimizer.lr=0.05"]
# the tiny MAE of tests/test_mae_training.py: debug=fast's 32-wide, 1-deep encoder on 8x8 digits, patch 2
MAE = ["model=mae_vit_nano", "module=mae", *QUIET, "model.embed_dim=32"]
# experiment=mae_fmnist_finetune shrunk onto that MAE: the digits, its image, patch and MLP sizes
FT_TINY = ["experiment=mae_fmnist_finetune", *QUIET, "data=digits", "data.val_split=0.1", "model.img_size=8",
           "model.patch_size=2", "model.mlp_ratio=4.0"]


def tiny_vit(**kw) -> nn.Module:
    return vitpipe.create_model("vit_nano", img_size=8, patch_size=4, in_chans=1, num_classes=5, dim=16, depth=1,
                                num_heads=2, **kw)


def classifier(net, **kw) -> ImageClassifier:
    return ImageClassifier(net, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), **kw)


def best_ckpt(run_dir: Path) -> Path:
    return next((run_dir / "checkpoints").glob("epoch_*.ckpt"))


def probe_logits(state: dict, cfg, x: torch.Tensor) -> torch.Tensor:
    """The probe's logits computed by hand from a checkpoint's tensors: a plain net of the stored model
    config for the pooled features, then (f - mean) / sqrt(var + 1e-6) and the head's weights."""
    from vitpipe.config.build import instantiate_checked

    plain = instantiate_checked(cfg.model, "model").eval()
    sd = {k[4:]: v for k, v in state.items() if k.startswith("net.")}
    plain.load_state_dict({k: v for k, v in sd.items() if not k.startswith("head.bn.")})
    with torch.no_grad():
        f = plain.forward_head(plain.forward_features(x), pre_logits=True)
        f = (f - sd["head.bn.running_mean"]) / torch.sqrt(sd["head.bn.running_var"] + 1e-6)
        return F.linear(f, sd["head.weight"], sd["head.bias"])


# --------------------------------------------------------------------------- module.probe_bn


def test_probe_bn_is_a_non_affine_batchnorm_before_the_head_with_running_stats():
    torch.manual_seed(0)
    plain_keys = set(classifier(tiny_vit()).state_dict())
    assert "net.head.weight" in plain_keys and not any(".bn." in k for k in plain_keys)  # default: keys unchanged
    net = tiny_vit()
    weight = net.head.weight.detach().clone()
    module = classifier(net, probe_bn=True)
    head = module.net.head
    assert isinstance(head, ProbeHead) and net.get_classifier() is head and torch.equal(head.weight, weight)
    bn = head.bn
    assert isinstance(bn, nn.BatchNorm1d) and not bn.affine and bn.eps == 1e-6 and bn.track_running_stats
    assert set(module.state_dict()) - plain_keys == {"net.head.bn.running_mean", "net.head.bn.running_var",
                                                     "net.head.bn.num_batches_tracked"}
    assert not any(p is not None for p in (bn.weight, bn.bias))  # no parameter: nothing for the optimizer

    x = torch.randn(32, 1, 8, 8) * 3 + 1
    feats = net.forward_head(net.forward_features(x), pre_logits=True).detach()
    net.train()
    net(x)  # a training forward updates the running statistics (momentum 0.1 from 0 / 1)
    assert torch.allclose(bn.running_mean, 0.1 * feats.mean(0), atol=1e-5)
    assert torch.allclose(bn.running_var, 0.9 + 0.1 * feats.var(0, unbiased=True), atol=1e-4)
    net.eval()
    with torch.no_grad():
        logits = net(x[:3])  # eval normalises with the running statistics, not the batch's
        by_hand = F.linear((feats[:3] - bn.running_mean) / torch.sqrt(bn.running_var + 1e-6), head.weight, head.bias)
        assert torch.allclose(logits, by_hand, atol=1e-5)
        folded = fold_probe_bn(net)  # the eval-mode BN absorbed into one Linear: the same logits
        assert type(folded.head) is nn.Linear and isinstance(net.head, ProbeHead)  # net itself untouched
        assert torch.allclose(folded(x[:3]), logits, atol=1e-5)
    assert fold_probe_bn(tiny_vit()).head.__class__ is nn.Linear


def test_probe_bn_refuses_a_network_without_one_linear_head():
    net = vitpipe.create_model("vit_nano", img_size=8, patch_size=4, in_chans=1, num_classes=5, dim=16, depth=1,
                               num_heads=2, dist_token=True)
    with pytest.raises(ValueError, match="module.probe_bn=true needs a network whose head is one nn.Linear"):
        classifier(net, probe_bn=True)
    with pytest.raises(ValueError, match="module.probe_bn='yes': expected true or false"):
        classifier(tiny_vit(), probe_bn="yes")


def test_a_linear_probe_with_probe_bn_changes_only_the_head_and_its_statistics(tmp_path):
    cfg = make_cfg(tmp_path, PROBE)
    dm, net, module = build_from_config(cfg)
    before = copy.deepcopy(net.state_dict())
    trainer = L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, accelerator="cpu")
    trainer.fit(module, dm)
    after = net.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == ["head.bias", "head.bn.num_batches_tracked", "head.bn.running_mean", "head.bn.running_var",
                       "head.weight"]
    assert after["head.bn.num_batches_tracked"].item() == 4
    assert all(not p.requires_grad for n, p in net.named_parameters() if not n.startswith("head."))


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """A debug=fast linear-probe run with probe_bn on the digits: (its run dir, best checkpoint)."""
    base = tmp_path_factory.mktemp("probe")
    cfg = make_cfg(base, PROBE)
    metrics = train(cfg)
    assert np.isfinite(metrics["val/loss"])
    run_dir = Path(cfg.paths.output_dir)
    return run_dir, best_ckpt(run_dir)


def test_a_probe_bn_checkpoint_rebuilds_to_the_same_logits(probe_run):
    _, path = probe_run
    ckpt = load_checkpoint(path)
    state = ckpt["state_dict"]
    assert state["net.head.bn.num_batches_tracked"].item() == 2  # debug=fast: 2 training batches
    assert not torch.allclose(state["net.head.bn.running_var"], torch.ones(1))  # the statistics were stored
    built = rebuild(ckpt, path)
    assert isinstance(built.net.head, ProbeHead) and not built.net.training
    x = torch.randn(6, 1, 8, 8)
    with torch.no_grad():
        logits = built.net(x)
    assert torch.allclose(logits, probe_logits(state, built.cfg, x), atol=1e-5)
    assert logits.std() > 0.01  # far from constant: the comparison means something


def test_a_probe_bn_checkpoint_exports_to_timm_with_the_bn_folded_and_to_onnx(probe_run, tmp_path):
    _, path = probe_run
    net = rebuild(load_checkpoint(path), path).net
    x = torch.randn(5, 1, 8, 8)
    out = export(make_cfg(tmp_path, [f"ckpt_path={path}", "format=timm", f"out={tmp_path / 'vit'}"],
                          config_name="export"))
    m = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert not any("bn" in k for k in m.state_dict())  # timm's own head: one Linear
    with torch.no_grad():
        assert (m(x) - net(x)).abs().max().item() <= 1e-5
    onnx = export(make_cfg(tmp_path, [f"ckpt_path={path}", "format=onnx", f"out={tmp_path / 'vit.onnx'}"],
                           config_name="export"))
    assert check_onnx(net, onnx, x) <= 1e-4


# --------------------------------------------------------------------------- the experiments


def test_the_experiments_are_the_mae_papers_recipes_on_mae_fmnists_encoder(cfg_factory):
    mae = cfg_factory("experiment=mae_fmnist", sub="mae").model
    ft = cfg_factory("experiment=mae_fmnist_finetune", sub="ft")
    check_config(ft)
    m = ft.model
    assert (m.img_size, m.patch_size, m.in_chans, m.dim, m.depth, m.num_heads, m.mlp_ratio, m.pos_embed) == (
        mae.img_size, mae.patch_size, mae.in_chans, mae.embed_dim, mae.depth, mae.num_heads, mae.mlp_ratio,
        mae.pos_embed)
    assert m._target_ == "vitpipe.create_model" and m.stem == "patch" and m.class_token is True
    assert m.pool == "mean" and m.drop_path_rate == 0.1 and m.pretrained is None
    mod = ft.module
    assert mod.layer_decay == 0.75 and mod.label_smoothing == 0.1 and mod.finetune == "full" and not mod.probe_bn
    assert dict(mod.mixup) == {"mixup_alpha": 0.8, "cutmix_alpha": 1.0} and ft.data.random_erasing == 0.25
    assert mod.optimizer._target_ == "torch.optim.AdamW" and list(mod.optimizer.betas) == [0.9, 0.999]
    assert mod.optimizer.weight_decay == 0.05 and mod.warmup_fraction > 0
    assert mod.scheduler._target_ == "timm.scheduler.CosineLRScheduler"
    assert cfg_factory("experiment=mae_fmnist_finetune", "data.train_per_class=60", sub="low").data.train_per_class == 60

    probe = cfg_factory("experiment=mae_fmnist_probe", sub="probe")
    check_config(probe)
    p = probe.module
    assert p.finetune == "linear_probe" and p.probe_bn is True and p.mixup is None and p.label_smoothing == 0.0
    assert probe.data.random_erasing == 0.0 and probe.model.pool == "cls"
    assert p.optimizer._target_ == "torch.optim.SGD" and "betas" not in p.optimizer  # no AdamW key left over
    assert (p.optimizer.lr, p.optimizer.momentum, p.optimizer.weight_decay) == (0.1, 0.9, 0.0)
    assert probe.lr_scaling.rule == "linear" and probe.lr_scaling.base_batch_size == 256
    assert probe.model.dim == m.dim and probe.model.depth == m.depth


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("mae")
    cfg = make_cfg(base, MAE)
    train(cfg)
    return Path(cfg.paths.output_dir)


@pytest.mark.parametrize("experiment", ["mae_fmnist_finetune", "mae_fmnist_probe"])
def test_the_experiments_train_from_a_tiny_mae_run(mae_run, tmp_path, experiment):
    """model.pretrained=<the MAE run dir>: every encoder tensor the classifier keeps is the MAE's (global
    pooling drops the MAE's final norm; fc_norm and the head start fresh), and the classifier trains."""
    overrides = [o if o != "experiment=mae_fmnist_finetune" else f"experiment={experiment}" for o in FT_TINY]
    cfg = make_cfg(tmp_path, [*overrides, f"model.pretrained={mae_run}"])
    _, net, _ = build_from_config(cfg)
    mae = {k[4:]: v for k, v in load_checkpoint(best_ckpt(mae_run))["state_dict"].items() if k.startswith("net.")}
    own = net.state_dict()
    fresh = ("head.", "fc_norm.")
    encoder = [k for k in own if not k.startswith(fresh)]
    assert encoder and [k for k in encoder if k not in mae or not torch.equal(own[k], mae[k])] == []
    assert ("norm.weight" in encoder) == (experiment == "mae_fmnist_probe")  # pool=cls keeps the MAE's norm
    metrics = train(cfg)
    assert np.isfinite(metrics["val/loss"]) and "val/acc" in metrics


def test_a_classifier_fine_tuned_from_an_mae_exports_to_timm_and_onnx(mae_run, tmp_path):
    cfg = make_cfg(tmp_path, [*FT_TINY, f"model.pretrained={mae_run}"])
    train(cfg)
    path = best_ckpt(Path(cfg.paths.output_dir))
    net = rebuild(load_checkpoint(path), path).net
    assert net.pool == "mean" and net.class_token
    x = torch.randn(5, 1, 8, 8)
    out = export(make_cfg(tmp_path, [f"ckpt_path={path}", "format=timm", f"out={tmp_path / 'vit'}"],
                          config_name="export"))
    m = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    assert m.global_pool == "avg" and m.cls_token is not None
    with torch.no_grad():
        assert (m(x) - net(x)).abs().max().item() <= 1e-5 and net(x).std() > 0.01
    onnx = export(make_cfg(tmp_path, [f"ckpt_path={path}", "format=onnx", f"out={tmp_path / 'vit.onnx'}"],
                           config_name="export"))
    assert check_onnx(net, onnx, x) <= 1e-4

"""Fine-tuning: layer-wise lr decay, linear probe, head-then-full, and the transfer experiment.

The expected rates are written from the spec (BEiT/MAE layer decay), not from the code under test:
block i trains at lr * d^(depth - i), the stem (patch embedding, positions, prefix tokens) at
lr * d^(depth + 1), the final norm and the head at lr.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from safetensors.torch import save_file
from timm.scheduler import CosineLRScheduler
from torch.utils.data import DataLoader, TensorDataset

from vitpipe.errors import ConfigError
from vitpipe.lit import ImageClassifier
from vitpipe.lit.optim import param_groups
from vitpipe.models import create_model
from vitpipe.run.build import build_from_config
from vitpipe.tasks.train import train

DEPTH, DECAY = 3, 0.5  # 0.5: every layer's rate is a distinct power of two


def expected_scale(name: str, depth: int = DEPTH, d: float = DECAY) -> float:
    if name.startswith(("patch_embed.", "pos_embed.", "cls_token", "reg_token")):
        return d ** (depth + 1)
    if name.startswith("blocks."):
        return d ** (depth - int(name.split(".")[1]))
    assert name.startswith(("norm.", "fc_norm.", "head.")), name
    return 1.0


def tiny_net(**kw):
    return create_model("vit_micro", img_size=8, patch_size=4, dim=16, depth=DEPTH, num_heads=2, num_classes=3, **kw)


def loader(seed: int = 0, n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)),
                      batch_size=8)


class StopAfter(L.Callback):
    """Ends fit after ``n`` optimizer steps without shortening the schedule (as max_steps would):
    the lr is then mid-schedule, where it still depends on each group's base value."""

    def __init__(self, n: int):
        self.n = n

    def on_train_batch_end(self, trainer, *args):
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.n


def fit(module, root: Path, *, max_steps: int = -1, max_epochs: int = 1, callbacks=()) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, max_epochs=max_epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, gradient_clip_val=1.0, default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=loader(0), val_dataloaders=loader(1))
    return trainer


ADAMW = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
TIMM_COSINE = partial(CosineLRScheduler, lr_min=1e-5, warmup_lr_init=1e-4, t_in_epochs=False)  # steps


def test_layer_decay_rates_in_the_optimizer_and_in_a_saved_checkpoint(tmp_path):
    torch.manual_seed(0)
    module = ImageClassifier(tiny_net(), ADAMW, TIMM_COSINE, warmup_fraction=0.25, layer_decay=DECAY)
    trainer = fit(module, tmp_path, max_epochs=2, callbacks=[StopAfter(3)])  # step 3 of 8, 2 warm-up steps
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == 3 and scheduler.t_initial == 8
    unscaled = 1e-5 + 0.5 * (1e-2 - 1e-5) * (1 + math.cos(math.pi * 3 / 8))  # timm's cosine (warmup_prefix=False)
    assert scheduler._get_lr(3)[0] == pytest.approx(unscaled, rel=1e-12)
    names = {id(p): n for n, p in module.net.named_parameters()}

    seen = []
    for group in optimizer.param_groups:
        scales = {expected_scale(names[id(p)]) for p in group["params"]}
        assert len(scales) == 1, [names[id(p)] for p in group["params"]]  # a group never mixes layers
        scale = scales.pop()
        assert group["lr_scale"] == pytest.approx(scale, rel=1e-12)
        assert group["lr"] == pytest.approx(unscaled * scale, rel=1e-9)  # timm applied it, once
        seen += [names[id(p)] for p in group["params"]]
    assert sorted(seen) == sorted(names.values())
    assert sorted({g["lr_scale"] for g in optimizer.param_groups}) == pytest.approx(
        sorted(DECAY ** k for k in range(DEPTH + 2)))  # stem, 3 blocks, head: five distinct rates

    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]["param_groups"]
    # the saved state numbers parameters in group order; a fresh net of the same shape names them
    fresh = tiny_net()
    fresh_names = {id(p): n for n, p in fresh.named_parameters()}
    order = [fresh_names[id(p)] for g in param_groups(fresh, 0.1, DECAY) for p in g["params"]]
    assert sum(len(g["params"]) for g in saved) == len(order)
    for group in saved:
        for index in group["params"]:
            assert group["lr_scale"] == pytest.approx(expected_scale(order[index]), rel=1e-12), order[index]
            assert group["lr"] == pytest.approx(unscaled * expected_scale(order[index]), rel=1e-9)


@pytest.mark.parametrize("schedule", ["none", "timm", "torch"])
def test_lr_scale_holds_once_whatever_the_scheduler(tmp_path, schedule):
    """No scheduler and torch schedulers never read lr_scale (vitpipe folds it into the lr once);
    timm's multiply by it on every update (folding it in as well would square it)."""
    factories = {"none": None, "timm": TIMM_COSINE,
                 "torch": partial(torch.optim.lr_scheduler.LinearLR, start_factor=0.5, total_iters=4)}
    module = ImageClassifier(tiny_net(), ADAMW, factories[schedule], warmup_fraction=0.0, layer_decay=DECAY)
    trainer = fit(module, tmp_path, callbacks=[StopAfter(2)])  # step 2 of 4
    assert trainer.global_step == 2
    unscaled = {"none": 1e-2, "timm": 1e-5 + 0.5 * (1e-2 - 1e-5) * (1 + math.cos(math.pi * 2 / 4)),
                "torch": 1e-2 * (0.5 + 0.5 * 2 / 4)}[schedule]
    names = {id(p): n for n, p in module.net.named_parameters()}
    for group in trainer.optimizers[0].param_groups:
        for p in group["params"]:
            assert group["lr"] == pytest.approx(unscaled * expected_scale(names[id(p)]), rel=1e-9), names[id(p)]


def test_without_layer_decay_every_group_has_the_full_lr(tmp_path):
    module = ImageClassifier(tiny_net(), ADAMW, None)
    trainer = fit(module, tmp_path, max_steps=1)
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [1e-2, 1e-2]


class Modes(L.Callback):
    """Records (encoder block training?, head training?, encoder requires grad?) at each training batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        net = pl_module.net
        self.seen.append((trainer.current_epoch, net.blocks[0].training, net.head.training,
                          net.blocks[0].attn.qkv.weight.requires_grad))


def test_linear_probe_trains_the_head_alone_with_the_encoder_in_eval_mode(tmp_path):
    torch.manual_seed(0)
    net = tiny_net(drop_path_rate=0.5)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = Modes()
    module = ImageClassifier(net, partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.5), None, finetune="linear_probe")
    trainer = fit(module, tmp_path, max_epochs=2, callbacks=[modes])  # validation in between flips modes back
    assert {m[1:] for m in modes.seen} == {(False, True, False)} and {m[0] for m in modes.seen} == {0, 1}
    optimizer = trainer.optimizers[0]
    assert [p for g in optimizer.param_groups for p in g["params"]] == [net.head.weight, net.head.bias]
    after = net.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("head."))
    assert not torch.equal(after["head.weight"], before["head.weight"])


def _pretrained_file(cfg, path: Path) -> dict[str, torch.Tensor]:
    """Random weights for the config's architecture, saved as a .safetensors file (every tensor
    of these nets is a parameter: sin-cos tables are non-persistent buffers)."""
    torch.manual_seed(123)
    node = cfg.model.copy()
    node.pretrained = None
    net = instantiate(node)
    weights = {k: v.contiguous() for k, v in net.state_dict().items()}
    assert len(weights) == len(list(net.parameters()))
    save_file(weights, str(path))
    return weights


def _encoder(sd: dict, prefix: str = "") -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and not k[len(prefix):].startswith("head.")}


FAST = ("debug=fast", "logger=none", "model.depth=2", "trainer.limit_val_batches=1", "module.optimizer.lr=1e-2",
        "module.optimizer.weight_decay=0.5", "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1", "test=false")


def test_linear_probe_checkpoint_holds_the_pretrained_encoder_bit_for_bit(cfg_factory, tmp_path):
    """Through the config: model.pretrained=<file> module.finetune=linear_probe, AdamW with weight
    decay 0.5; every encoder tensor in the saved checkpoint equals the file's, the head moved."""
    cfg = cfg_factory(*FAST)
    source = _pretrained_file(cfg, tmp_path / "source.safetensors")
    cfg = cfg_factory(*FAST, f"model.pretrained={tmp_path / 'source.safetensors'}", "module.finetune=linear_probe",
                      "trainer.max_epochs=2", sub="probe")
    train(cfg)
    ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
    state = ckpt["state_dict"]
    encoder = _encoder(state, "net.")
    assert encoder.keys() == _encoder(source).keys() and len(encoder) > 10
    assert all(torch.equal(encoder[k], v) for k, v in _encoder(source).items())
    assert not torch.equal(state["net.head.weight"], source["head.weight"])
    assert not torch.equal(state["net.head.bias"], source["head.bias"])
    # the encoder is in no optimizer group: nothing could decay it
    assert sum(len(g["params"]) for g in ckpt["optimizer_states"][0]["param_groups"]) == 2


def test_head_then_full_encoder_waits_for_the_warmup_epochs(cfg_factory, tmp_path, capsys):
    cfg = cfg_factory(*FAST)
    source = _pretrained_file(cfg, tmp_path / "source.safetensors")
    cfg = cfg_factory(*FAST, f"model.pretrained={tmp_path / 'source.safetensors'}", "module.finetune=head_then_full",
                      "module.finetune_warmup_epochs=1", "module.layer_decay=0.65", "trainer.max_epochs=2",
                      "module.warmup_fraction=0.0", sub="lpft")
    train(cfg)
    assert "vitpipe: epoch 1: encoder unfrozen (module.finetune=head_then_full)" in capsys.readouterr().out
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    first, second = (torch.load(folder / f"epoch_00{i}.ckpt", weights_only=True) for i in (0, 1))
    n_params = len(source)
    for ckpt in (first, second):  # every group (encoder included, with its layer rates) from the start
        groups = ckpt["optimizer_states"][0]["param_groups"]
        assert sum(len(g["params"]) for g in groups) == n_params and len({g["lr_scale"] for g in groups}) == 4

    warm = _encoder(first["state_dict"], "net.")
    assert all(torch.equal(warm[k], v) for k, v in _encoder(source).items())  # epoch 0: the head alone
    assert not torch.equal(first["state_dict"]["net.head.weight"], source["head.weight"])
    assert len(first["optimizer_states"][0]["state"]) == 2  # AdamW never touched an encoder tensor

    full = _encoder(second["state_dict"], "net.")
    changed = [k for k, v in _encoder(source).items() if not torch.equal(full[k], v)]
    assert len(changed) == len(full)  # epoch 1: every encoder tensor trained
    assert len(second["optimizer_states"][0]["state"]) == n_params


@pytest.mark.parametrize("override, words", [
    ("module.finetune=probe", "module.finetune='probe'; valid choices: full, linear_probe, head_then_full, lora"),
    ("module.finetune=head_then_full", "needs module.finetune_warmup_epochs >= 1"),
    ("module.layer_decay=1.5", "module.layer_decay=1.5: expected a number in (0, 1]"),
    ("module.layer_decay=0", "module.layer_decay=0: expected a number in (0, 1]"),
    ("module.finetune_warmup_epochs=-1", "module.finetune_warmup_epochs=-1: expected an int >= 0"),
])
def test_bad_finetune_settings_fail_in_one_line_before_training(cfg_factory, override, words):
    with pytest.raises(ConfigError) as err:
        build_from_config(cfg_factory("debug=fast", override))
    assert words in str(err.value) and "\n" not in str(err.value)


# ---- the transfer experiment (README "Fine-tuning"), on the real Fashion-MNIST --------------------

DEBIAN_FMNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(DEBIAN_FMNIST), reason="Debian's dataset-fashion-mnist is not installed")
def test_transfer_fine_tuning_beats_training_from_scratch(cfg_factory):
    """experiment=transfer_source, then transfer_target with 10 images per class from scratch and
    fine-tuned, 3 seeds each. Measured (conf/experiment/transfer_target.yaml): scratch 0.741 / 0.743 /
    0.754, full fine-tune 0.819 / 0.836 / 0.842 (seeds 0, 1, 2): 7.8-9.3 points apart; asked here: 4."""
    source = cfg_factory("experiment=transfer_source", "logger=none", "test=false", sub="source")
    train(source)
    ckpt = Path(source.paths.output_dir) / "checkpoints" / "last.ckpt"
    accs = {}
    for arm, extra in (("scratch", "model.pretrained=null"), ("full", f"model.pretrained={ckpt}")):
        for seed in (0, 1, 2):
            cfg = cfg_factory("experiment=transfer_target", "logger=none", f"seed={seed}", extra,
                              "data.train_per_class=10", "data.batch_size=10", sub=f"{arm}{seed}")
            accs[arm, seed] = train(cfg)["test/acc"]
    for seed in (0, 1, 2):
        assert accs["full", seed] > accs["scratch", seed] + 0.04, accs

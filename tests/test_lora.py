"""LoRA fine-tuning (module.finetune=lora, vitpipe.models.lora): the merge is exact, only the adapters and the
head train, every command that reads the run back sees the merged network, and a resume restores the adapters
and their optimizer state bit for bit.

The expected numbers come from the definition (Hu et al. 2021): an adapted layer is ``W x + (alpha / r) B A x``
with ``A`` (r, in) and ``B`` (out, r); the merged layer's weight is ``W + (alpha / r) B A``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import timm
import torch
from conftest import make_cfg
from hydra.utils import instantiate
from PIL import Image
from safetensors.torch import save_file

from vitpipe.config.preflight import preflight
from vitpipe.errors import ConfigError
from vitpipe.models import create_model
from vitpipe.models.lora import add_lora, has_lora, lora_settings, merge_lora, merge_lora_state_dict
from vitpipe.run.build import build_from_config
from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint

pytest.importorskip("peft")

DIM, DEPTH, HIDDEN, CLASSES, R, ALPHA = 16, 2, 64, 3, 4, 8.0


def tiny_net():
    return create_model("vit_micro", img_size=8, patch_size=4, dim=DIM, depth=DEPTH, num_heads=2, mlp_ratio=4.0,
                        num_classes=CLASSES)


def adapted(seed: int = 0):
    """A tiny ViT with adapters whose B is not zero (as after training), in eval mode."""
    torch.manual_seed(seed)
    net = add_lora(tiny_net(), {"r": R, "alpha": ALPHA})
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2)
    return net.eval()


def test_merged_network_gives_the_adapted_logits_and_plain_keys():
    net = adapted()
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        want = net(x)
        state = {k: v.clone() for k, v in net.state_dict().items()}
        merged = merge_lora(copy.deepcopy(net))
        got = merged(x)
    torch.manual_seed(0)
    with torch.no_grad():
        base = tiny_net().eval()(x)  # the same base weights (adapted() seeds 0 before building), no adapters
    assert (got - want).abs().max() < 1e-5 and (want - base).abs().max() > 1e-2  # the adapters matter
    assert not has_lora(merged) and merged.state_dict().keys() == tiny_net().state_dict().keys()
    assert all(p.requires_grad for p in merged.parameters())  # an ordinary network again
    # the definition, by hand on one layer: W + (alpha / r) B A
    a, b = state["blocks.0.attn.qkv.lora_A.default.weight"], state["blocks.0.attn.qkv.lora_B.default.weight"]
    w = state["blocks.0.attn.qkv.base_layer.weight"] + (ALPHA / R) * b @ a
    assert torch.allclose(merged.blocks[0].attn.qkv.weight, w, atol=1e-6)
    # the same merge on a state dict (model.pretrained=<a LoRA run>)
    sd = merge_lora_state_dict(state, ALPHA)
    assert sd.keys() == merged.state_dict().keys()
    assert all(torch.allclose(sd[k], v, atol=1e-6) for k, v in merged.state_dict().items())


def test_only_the_adapters_and_the_head_train():
    net = add_lora(tiny_net(), {"r": R})
    trainable = {n: p.numel() for n, p in net.named_parameters() if p.requires_grad}
    # per block: qkv dim -> 3 dim, fc1 dim -> hidden, fc2 hidden -> dim; A (r, in) + B (out, r) each
    per_block = R * (DIM + 3 * DIM) + R * (DIM + HIDDEN) + R * (HIDDEN + DIM)
    assert sum(trainable.values()) == DEPTH * per_block + DIM * CLASSES + CLASSES
    assert {n for n in trainable if ".lora_" not in n} == {"head.weight", "head.bias"}
    assert not any(".proj." in n for n in trainable)  # attn.proj is not a default target, patch_embed.proj a Conv2d


@pytest.mark.parametrize("lora, words", [
    ({"targets": ["attn"]}, "module.lora.targets: 'attn': ViT has no linear layer of that name outside its head; "
                            "valid: fc1, fc2, proj, qkv"),
    ({"targets": ["qkv", "head"]}, "'head': the head trains in full, it takes no adapter; valid: fc1, fc2, proj, qkv"),
    ({"r": 0}, "module.lora.r=0 must be a positive integer"),
    ({"alpha": -1}, "module.lora.alpha=-1 must be a number > 0"),
    ({"rank": 8}, "module.lora.rank is not a LoRA setting; valid: r, alpha, dropout, targets"),
])
def test_bad_lora_settings_are_one_line(lora, words):
    with pytest.raises(ConfigError) as err:
        add_lora(tiny_net(), lora)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override, words", [
    ("module.lora.r=0", "module.lora.r=0 must be a positive integer"),
    ("module.lora.r=-4", "module.lora.r=-4 must be a positive integer"),
    ("module.lora.dropout=1.0", "module.lora.dropout=1.0 must be in [0, 1)"),
    ("module.lora.targets=[qkv,attn]", "'attn': ViT has no linear layer of that name outside its head; valid: "),
])
def test_bad_settings_through_the_config_fail_before_training(cfg_factory, tmp_path, override, words):
    node = cfg_factory("debug=fast").model.copy()
    node.pretrained = None
    save_file(instantiate(node).state_dict(), str(tmp_path / "w.safetensors"))
    cfg = cfg_factory("debug=fast", "logger=none", "module.finetune=lora",
                      f"model.pretrained={tmp_path / 'w.safetensors'}", override, sub="run")
    with pytest.raises(ConfigError) as err:
        build_from_config(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_lora_without_pretrained_weights_is_refused(cfg_factory):
    cfg = cfg_factory("debug=fast", "logger=none", "module.finetune=lora")
    with pytest.raises(ConfigError) as err:
        preflight(cfg, "train")
    assert str(err.value).startswith("module.finetune=lora adapts pretrained weights, but model.pretrained is null")


# ---- a real run: digits, from a pretrained file, read back by every command ----------------------------------

FAST = ("debug=fast", "logger=none", "model.depth=2", "module.optimizer.lr=1e-2", "trainer.limit_val_batches=1",
        "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.save_top_k=-1", "test=false",
        "module.finetune=lora", "module.lora.r=4", "module.lora.alpha=8")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(source weights, the config, last.ckpt) of a LoRA run: 2 steps on digits from random 'pretrained' weights."""
    from vitpipe.tasks.train import train

    base = tmp_path_factory.mktemp("lora")
    node = make_cfg(base / "src", FAST).model.copy()
    node.pretrained = None
    torch.manual_seed(123)
    source = {k: v.contiguous() for k, v in instantiate(node).state_dict().items()}
    save_file(source, str(base / "source.safetensors"))
    cfg = make_cfg(base / "run", [*FAST, f"model.pretrained={base / 'source.safetensors'}"])
    train(cfg)
    return source, cfg, Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"


def adapted_from(ckpt: Path) -> torch.nn.Module:
    """The network as it trained, adapters unmerged: built by hand from the stored config and state dict."""
    checkpoint = load_checkpoint(ckpt)
    stored = checkpoint["vitpipe_config"]
    node = {**stored["model"], "pretrained": None}
    net = add_lora(instantiate(node), lora_settings(stored["module"]["lora"]))
    net.load_state_dict({k[4:]: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")})
    return net.eval()


def test_checkpoint_keeps_adapters_and_the_frozen_base(lora_run):
    source, _, ckpt = lora_run
    state = load_checkpoint(ckpt)["state_dict"]
    assert any(".lora_B.default." in k for k in state)
    assert any(v.abs().max() > 0 for k, v in state.items() if ".lora_B." in k)  # B moved off its zero start
    for k, v in source.items():  # the frozen base, bit for bit; the head trained
        key = "net." + (k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
                        if any(f".{t}." in k for t in ("qkv", "fc1", "fc2")) else k)
        assert torch.equal(state[key], v) != k.startswith("head."), k


def test_every_reader_sees_the_merged_network(lora_run, tmp_path):
    """rebuild (predict, serve, visualize, eval, export), eval's metrics, predict's probabilities and both
    exports give the adapted network's answers."""
    import onnxruntime as ort

    from vitpipe.tasks.evaluate import evaluate
    from vitpipe.tasks.export import export
    from vitpipe.tasks.predict import predict

    _, _, ckpt = lora_run
    net = adapted_from(ckpt)
    run = rebuild(load_checkpoint(ckpt), ckpt)
    assert not has_lora(run.net) and not has_lora(run.module)
    dm = run.datamodule
    dm.setup("test")
    xs, ys = zip(*dm.test_dataloader())
    x = dm.augment_batch(torch.cat(xs), train=False)
    y = torch.cat(ys)
    with torch.no_grad():
        want = net(x)
        assert (run.net(x) - want).abs().max() < 1e-5

    metrics = evaluate(make_cfg(tmp_path / "eval", [f"ckpt_path={ckpt}", "trainer.accelerator=cpu"], "eval"))
    assert metrics["test/acc"] == pytest.approx((want.argmax(-1) == y).float().mean().item(), abs=1e-6)
    assert metrics["test/loss"] == pytest.approx(torch.nn.functional.cross_entropy(want, y).item(), abs=1e-5)

    folder = tmp_path / "digits"
    folder.mkdir()
    raw = xs[0][:6]
    for i, img in enumerate(raw[:, 0].numpy()):
        Image.fromarray(img).save(folder / f"{i}.png")
    out = predict(make_cfg(tmp_path / "p", [f"ckpt_path={ckpt}", f"images={folder}", "topk=1",
                                            f"out={tmp_path / 'p.json'}"], "predict"))
    got = torch.tensor([r["prob"] for r in json.loads(out.read_text())])
    assert (got - want[:6].softmax(-1).max(-1).values).abs().max() < 1e-5

    folder_out = export(make_cfg(tmp_path / "e", [f"ckpt_path={ckpt}", "format=timm", f"out={tmp_path / 'vit'}"],
                                 "export"))
    tm = timm.create_model(f"local-dir:{folder_out}", pretrained=True).eval()
    assert not any("lora" in k for k in tm.state_dict())
    with torch.no_grad():
        assert (tm(x[:8]) - want[:8]).abs().max() < 1e-5

    onnx = export(make_cfg(tmp_path / "o", [f"ckpt_path={ckpt}", "format=onnx", f"out={tmp_path / 'm.onnx'}"],
                           "export"))
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"images": x[:8].numpy()})[0]
    assert np.abs(logits - want[:8].numpy()).max() < 1e-4


def test_pretrained_from_a_lora_run_loads_the_merged_weights(lora_run):
    from vitpipe.models.weights import load_pretrained

    _, cfg, ckpt = lora_run
    node = cfg.model.copy()
    node.pretrained = None
    net = load_pretrained(instantiate(node), ckpt).eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert (net(x) - adapted_from(ckpt)(x)).abs().max() < 1e-5


class Restored(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.state = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())


def test_resume_restores_adapters_and_their_optimizer_state_exactly(lora_run, capsys):
    """The run stopped after epoch 0 (last.ckpt); a resume as train does it (Trainer.fit(ckpt_path=)) starts
    from exactly those adapters and AdamW moments, and trains the adapters and the head alone."""
    _, cfg, ckpt = lora_run
    checkpoint = load_checkpoint(ckpt)
    cfg = cfg.copy()
    cfg.trainer.max_epochs = 2
    dm, net, module = build_from_config(cfg)
    seen = Restored()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[seen])
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt, weights_only=True)
    trainable = sum(p.numel() for p in module.net.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.net.parameters())
    out = capsys.readouterr().out  # the footprint lines at fit start and end
    assert f"vitpipe: fit: {trainable:,} of {total:,} parameters trainable (" in out and "module.finetune=lora)" in out
    assert "vitpipe: fit: peak memory " in out
    assert seen.state.keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(seen.state[k], v) for k, v in checkpoint["state_dict"].items())
    saved, restored = checkpoint["optimizer_states"][0], seen.optimizer
    depth = cfg.model.depth  # A and B on qkv, fc1, fc2 of every block, then the head's weight and bias
    assert sum(len(g["params"]) for g in saved["param_groups"]) == 3 * 2 * depth + 2
    assert saved["state"].keys() == restored["state"].keys()
    for i, s in saved["state"].items():
        assert all(torch.equal(s[k], restored["state"][i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # after the resumed epoch: the base still the checkpoint's, the adapters moved on
    after = module.state_dict()
    base = [k for k in after if ".base_layer." in k]
    assert base and all(torch.equal(after[k], checkpoint["state_dict"][k]) for k in base)
    assert not all(torch.equal(after[k], checkpoint["state_dict"][k]) for k in after if ".lora_B." in k)


def test_an_ema_run_reads_back_as_its_merged_ema_network(lora_run, tmp_path):
    """module.ema_decay with LoRA: the EMA copy keeps adapters too (checkpoint keys ema.module.*), and the
    network every reader gets is the EMA's, merged."""
    from vitpipe.tasks.train import train

    _, cfg, _ = lora_run
    cfg = make_cfg(tmp_path, [*FAST, f"model.pretrained={cfg.model.pretrained}", "module.ema_decay=0.5"])
    train(cfg)
    ckpt = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    checkpoint = load_checkpoint(ckpt)
    assert any(k.startswith("ema.module.") and ".lora_B." in k for k in checkpoint["state_dict"])
    ema = {k.replace("ema.module.", "net.", 1): v for k, v in checkpoint["state_dict"].items() if k.startswith("ema.")}
    net = adapted_from(ckpt)
    net.load_state_dict({k[4:]: v for k, v in ema.items()})
    run = rebuild(checkpoint, ckpt)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert not has_lora(run.net) and (run.net(x) - net(x)).abs().max() < 1e-5

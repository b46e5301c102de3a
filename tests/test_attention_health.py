"""Attention health (vitpipe/lit/attention_health.py): the numbers against a hand computation, the
callback in a tiny fit (steps, keys, file, fused training steps, training unchanged), the warning
rules (once per signal), and the report's figure."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitpipe.errors import ConfigError
from vitpipe.lit.attention_health import (
    HEALTH_FILE,
    AttentionHealth,
    attention_stats,
    measure,
    read_attention_health,
)
from vitpipe.models.vit import ViT
from vitpipe.nn.naflex import pad_batch, patchify_image
from vitpipe.tasks.train import train


def tiny_vit(**kw) -> ViT:
    torch.manual_seed(0)
    args = dict(img_size=8, patch_size=4, in_chans=1, num_classes=3, dim=8, depth=2, num_heads=2, pos_embed="learned")
    return ViT(**{**args, **kw})


# ---------------------------------------------------------------- the numbers


def test_known_answers_of_the_statistics():
    # uniform attention over 4 keys: entropy log 4 nats, normalised 1; logits all 0.5
    uniform = torch.full((1, 1, 3, 4), 0.5)
    # one key at +30 and three at 0: p = [1, e^-30, e^-30, e^-30] / Z, entropy ~ 3 * 30 e^-30 ~ 0
    peaked = torch.zeros(1, 1, 3, 4)
    peaked[..., 0] = 30.0
    # two keys masked (-inf): uniform over the other two, entropy log 2 and normalised by log 2 = 1
    masked = torch.tensor([0.0, 0.0, -math.inf, -math.inf]).expand(1, 1, 3, 4)
    s = attention_stats([torch.cat([uniform, peaked, masked], dim=1)])  # one layer, three heads
    torch.testing.assert_close(s["entropy"], torch.tensor([[math.log(4), 0.0, math.log(2)]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(s["entropy_norm"], torch.tensor([[1.0, 0.0, 1.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(s["max_logit"], torch.tensor([[0.5, 30.0, 0.0]]))


def test_a_query_mask_leaves_rows_out():
    # query 1 is padding: its row (one-hot, logit 99) must not count
    logits = torch.zeros(1, 1, 2, 3)
    logits[0, 0, 1, 0] = 99.0
    s = attention_stats([logits], query_mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(s["entropy"], torch.tensor([[math.log(3)]]))
    assert float(s["max_logit"]) == 0.0


def hand_stats(net: ViT, x: torch.Tensor) -> tuple[list[list[float]], list[list[float]]]:
    """Entropy and max logit per layer and head from q and k computed by hand from each block's qkv
    weights (the attention input caught by a forward pre-hook), softmax and -sum p log p in plain Python."""
    inputs = []
    hooks = [blk.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().double())) for blk in net.blocks]
    with torch.no_grad():
        net.eval()(x)
    for h in hooks:
        h.remove()
    entropy, max_logit = [], []
    for blk, a in zip(net.blocks, inputs):
        heads, hd = blk.attn.num_heads, blk.attn.head_dim
        qkv = a @ blk.attn.qkv.weight.detach().double().T + blk.attn.qkv.bias.detach().double()  # (B, N, 3 * dim)
        B, N, _ = qkv.shape
        q, k = qkv[..., : heads * hd], qkv[..., heads * hd : 2 * heads * hd]
        ent_row, max_row = [], []
        for h in range(heads):
            total, top = 0.0, -math.inf
            for b in range(B):
                for i in range(N):
                    row = [
                        sum(float(q[b, i, h * hd + d] * k[b, j, h * hd + d]) for d in range(hd)) / math.sqrt(hd) for j in range(N)
                    ]
                    top = max(top, *row)
                    z = sum(math.exp(v - max(row)) for v in row)
                    p = [math.exp(v - max(row)) / z for v in row]
                    total += -sum(pi * math.log(pi) for pi in p if pi > 0)
            ent_row.append(total / (B * N))
            max_row.append(top)
        entropy.append(ent_row)
        max_logit.append(max_row)
    return entropy, max_logit


def test_entropy_and_max_logit_equal_a_hand_computation():
    net = tiny_vit()
    x = torch.randn(3, 1, 8, 8)
    entropy, max_logit = hand_stats(net, x)
    net.train()  # measure switches to eval for its call and back
    s = measure(net, x)
    assert net.training and all(m.training for m in net.modules())
    torch.testing.assert_close(s["entropy"], torch.tensor(entropy, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s["max_logit"], torch.tensor(max_logit, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s["entropy_norm"], s["entropy"] / math.log(1 + 4))  # class token + 2x2 patches
    # the softmax of the logits is the core's own explicit attention (return_attn)
    with torch.no_grad():
        _, weights = net.eval().forward_features(x, return_attn=True)
    torch.testing.assert_close(attention_stats([w.clamp_min(1e-30).log() for w in weights])["entropy"], s["entropy"])


def test_patch_dicts_count_valid_queries_only():
    """A padded NaFlex batch gives what its images give one by one, weighted by their queries."""
    net = tiny_vit(pos_embed="learned", num_classes=0)
    torch.manual_seed(1)
    items = [patchify_image(torch.randn(1, 8, 8), 4, 4), patchify_image(torch.randn(1, 4, 8), 4, 4)]  # 4, 2 patches
    together = measure(net, pad_batch(items))
    alone = [measure(net, pad_batch([it])) for it in items]
    queries = torch.tensor([1.0 + 4, 1.0 + 2])  # class token + valid patches
    expected = (alone[0]["entropy"] * queries[0] + alone[1]["entropy"] * queries[1]) / queries.sum()
    torch.testing.assert_close(together["entropy"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together["max_logit"], torch.maximum(alone[0]["max_logit"], alone[1]["max_logit"]))


# ---------------------------------------------------------------- the warnings


class FakeLogger:
    def __init__(self):
        self.logged = []

    def log_metrics(self, metrics, step):
        self.logged.append((step, dict(metrics)))


def fake_trainer(tmp_path, step=0):
    return SimpleNamespace(global_step=step, is_global_zero=True, loggers=[FakeLogger()], default_root_dir=str(tmp_path))


def test_collapse_warns_once_naming_layer_head_value_and_threshold(tmp_path, capsys):
    net = tiny_vit()
    with torch.no_grad():
        net.blocks[1].attn.qkv.weight[:16] *= 300  # q and k of layer 1 scaled: one-hot attention (~1e-6 nats)
    cb = AttentionHealth(every_n_steps=1, max_logit=None, growth_checks=None)
    cb.inputs = torch.randn(4, 1, 8, 8)
    module = SimpleNamespace(net=net)
    trainer = fake_trainer(tmp_path)
    for step in range(4):
        trainer.global_step = step
        cb.check(trainer, module)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # once per run, not once per check
    assert err[0].startswith("vitpipe: warning: attention entropy collapse at step 0: layer 1 head ")
    assert "< callbacks.attention_health.min_entropy=0.1" in err[0]
    assert "module.optimizer.lr" in err[0] and "model.qk_norm=true" in err[0] and "warmup" in err[0]
    assert cb.warned == {"entropy": True, "logit": False}
    # a resumed run remembers it warned (the state travels in checkpoints)
    again = AttentionHealth(every_n_steps=1, max_logit=None, growth_checks=None)
    again.load_state_dict(cb.state_dict())
    trainer.global_step = 4
    again.check(trainer, module)
    assert capsys.readouterr().err == ""


def test_logit_growth_warns_once_after_k_rising_checks(tmp_path, capsys):
    net = tiny_vit()
    cb = AttentionHealth(every_n_steps=1, min_entropy=None, max_logit=None, growth_checks=3, growth_factor=2.0, growth_from=0.0)
    cb.inputs = torch.randn(4, 1, 8, 8)
    module, trainer = SimpleNamespace(net=net), fake_trainer(tmp_path)
    warned_at = []
    for step in range(6):
        trainer.global_step = step
        with torch.no_grad():
            net.blocks[0].attn.qkv.weight[:16] *= 1.5  # q and k grow: logits x2.25 a check
        cb.check(trainer, module)
        if capsys.readouterr().err:
            warned_at.append(step)
    assert warned_at == [3]  # 3 rises need 4 checks; then silent
    assert cb.warned["logit"]


def test_growth_below_growth_from_is_not_warned(tmp_path, capsys):
    # early training: logits grow from small values in any healthy run
    net = tiny_vit()
    cb = AttentionHealth(every_n_steps=1, min_entropy=None, max_logit=None, growth_checks=2, growth_from=1e6)
    cb.inputs = torch.randn(2, 1, 8, 8)
    module, trainer = SimpleNamespace(net=net), fake_trainer(tmp_path)
    for step in range(4):
        trainer.global_step = step
        with torch.no_grad():
            net.blocks[0].attn.qkv.weight[:16] *= 2
        cb.check(trainer, module)
    assert capsys.readouterr().err == ""


def test_max_logit_threshold_warns(tmp_path, capsys):
    net = tiny_vit()
    with torch.no_grad():
        net.blocks[0].attn.qkv.weight[:16] *= 100
    cb = AttentionHealth(min_entropy=None, max_logit=50.0)
    cb.inputs = torch.randn(2, 1, 8, 8)
    cb.check(fake_trainer(tmp_path, step=7), SimpleNamespace(net=net))
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitpipe: warning: attention logit growth at step 7: layer 0 head ")
    assert "> callbacks.attention_health.max_logit=50" in err and "model.qk_norm=true" in err
    # a model with QK-LayerNorm already is not told to turn it on
    net = tiny_vit(qk_norm=True)
    with torch.no_grad():
        for blk in net.blocks:
            blk.attn.q_norm.weight.fill_(100.0)
    cb = AttentionHealth(min_entropy=None, max_logit=50.0)
    cb.inputs = torch.randn(2, 1, 8, 8)
    cb.check(fake_trainer(tmp_path), SimpleNamespace(net=net))
    err = capsys.readouterr().err.strip()
    assert "max_logit=50" in err and "model.qk_norm is on" in err and "model.qk_norm=true" not in err


def test_bad_options_and_non_vits(capsys):
    with pytest.raises(ConfigError, match=r"every_n_steps=0: use an int >= 1"):
        AttentionHealth(every_n_steps=0)
    with pytest.raises(ConfigError, match=r"growth_factor=1"):
        AttentionHealth(growth_factor=1)
    cb = AttentionHealth()
    cb.on_fit_start(SimpleNamespace(is_global_zero=True), SimpleNamespace(net=torch.nn.Linear(2, 2)))
    assert cb.off
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "callbacks.attention_health: Linear is not a vitpipe ViT" in out[0]


def test_a_captioner_is_measured_on_its_encoder_and_its_batch_images():
    from vitpipe.lit.attention_health import _inputs, find_vit

    encoder = tiny_vit(num_classes=0)
    module = SimpleNamespace(net=SimpleNamespace(encoder=encoder))  # a captioner's shape: net.encoder
    assert find_vit(module) is encoder
    images = torch.randn(5, 1, 8, 8)
    x = _inputs({"images": images, "tokens": torch.zeros(5, 7, dtype=torch.long)}, 3)
    assert torch.equal(x, images[:3]) and x.data_ptr() != images.data_ptr()  # a copy, fixed for the run
    assert torch.equal(_inputs((images, torch.arange(5)), 2), images[:2])


# ---------------------------------------------------------------- in a fit


def test_a_tiny_fit_logs_checks_writes_the_file_keeps_sdpa_and_reports(cfg_factory, monkeypatch):
    from vitpipe.lit.classifier import ImageClassifier

    state = {"training": False, "sdpa_in_training": 0, "explicit": []}
    real_sdpa, real_ff, real_step = F.scaled_dot_product_attention, ViT.forward_features, ImageClassifier.training_step

    def counting_sdpa(*args, **kw):
        state["sdpa_in_training"] += state["training"]
        return real_sdpa(*args, **kw)

    def spying_forward_features(self, x, *, return_attn=False, return_logits=False):
        if return_attn or return_logits:
            assert not state["training"], "a training step took the explicit attention path"
            state["explicit"].append(not self.training)
        return real_ff(self, x, return_attn=return_attn, return_logits=return_logits)

    def flagged_step(self, batch, batch_idx):
        state["training"] = True
        try:
            return real_step(self, batch, batch_idx)
        finally:
            state["training"] = False

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(ViT, "forward_features", spying_forward_features)
    monkeypatch.setattr(ImageClassifier, "training_step", flagged_step)
    cfg = cfg_factory(
        "debug=fast",
        "model.depth=2",
        "callbacks=attention_health",
        "callbacks.attention_health.every_n_steps=2",
        "callbacks.attention_health.num_images=4",
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=3",
        "callbacks.progress_bar.refresh_rate=1000",
    )
    train(cfg)
    run = Path(cfg.paths.output_dir)

    # 6 steps: checks at 0, 2, 4 and at the end (6), each one eval-mode explicit forward
    assert state["explicit"] == [True] * 4
    assert state["sdpa_in_training"] == 2 * 6  # every training step fused: one SDPA call per block
    rows = read_attention_health(run / HEALTH_FILE)
    assert [(r["step"], r["layer"], r["head"]) for r in rows] == [
        (s, i, j) for s in (0, 2, 4, 6) for i in range(2) for j in range(2)
    ]
    assert all(0 <= r["entropy"] <= math.log(1 + 16) + 1e-6 for r in rows)  # class token + 4x4 patches

    # the CSV logger has every per-layer/per-head key at exactly those steps
    with open(next((run / "csv").rglob("metrics.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r.get("attn/entropy/l1/h1")]
    assert [int(r["step"]) for r in logged] == [0, 2, 4, 6]
    keys = {f"attn/{n}/l{i}/h{j}" for n in ("entropy", "max_logit") for i in range(2) for j in range(2)}
    assert keys | {"attn/entropy_min", "attn/max_logit_max"} <= set(logged[0])
    by_step = {(r["step"], r["layer"], r["head"]): r for r in rows}
    assert float(logged[1]["attn/max_logit/l1/h0"]) == pytest.approx(by_step[(2, 1, 0)]["max_logit"], rel=1e-5)

    # the report (after test) draws the file
    png = run / "report" / "attention_health.png"
    assert png.is_file() and Image.open(png).size == (1100, 400)
    assert "![attention entropy and logits](attention_health.png)" in (run / "report" / "report.md").read_text()


def test_training_is_the_same_with_and_without_the_callback(cfg_factory):
    """The callback's forward takes no gradient, draws no random numbers and leaves the modes as they
    were: the trained weights are bit for bit those of a run without it."""
    common = (
        "debug=fast",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        "test=false",
        "logger=none",
        "callbacks.progress_bar.refresh_rate=1000",
        "module.optimizer.lr=1e-2",
        "model.depth=2",  # drop path in the second block (the rate grows from 0 over the depth)
        "model.drop_path_rate=0.1",
    )
    weights = []
    for sub, extra in (("on", ("callbacks=attention_health", "callbacks.attention_health.every_n_steps=1")), ("off", ())):
        cfg = cfg_factory(*common, *extra, sub=sub)
        train(cfg)
        ckpt = torch.load(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt", weights_only=True)
        weights.append({k: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")})
    assert (Path(cfg_factory(*common, sub="on").paths.output_dir) / HEALTH_FILE).is_file()
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_config_group_alone_and_with_another(cfg_factory):
    """callbacks=attention_health (the default callbacks plus this one) and a list of optional groups,
    as docs/attention-health.md shows them; the file's values are the class's defaults."""
    import inspect

    from hydra.utils import instantiate

    cfg = cfg_factory("callbacks=attention_health")
    assert {"model_checkpoint", "history", "report", "attention_health"} <= set(cfg.callbacks)
    cb = instantiate(cfg.callbacks.attention_health)
    assert isinstance(cb, AttentionHealth) and cb.dirpath == cfg.paths.output_dir
    defaults = {k: p.default for k, p in inspect.signature(AttentionHealth).parameters.items() if k != "dirpath"}
    assert {k: getattr(cb, k) for k in defaults} == defaults
    both = cfg_factory("callbacks=[rollout,attention_health]", sub="both")
    assert {"rollout", "attention_health", "model_checkpoint"} <= set(both.callbacks)


def test_a_resumed_run_keeps_its_checks_and_its_images(cfg_factory):
    """The checks and the fixed images travel in last.ckpt: the resumed run (ckpt_path=auto, same run
    dir) measures the same images and writes the whole curve, each step once."""
    common = ("debug=fast", "trainer.limit_train_batches=2", "test=false", "logger=none",
              "callbacks=attention_health", "callbacks.attention_health.every_n_steps=2",
              "callbacks.progress_bar.refresh_rate=1000")  # fmt: skip
    cfg = cfg_factory(*common, "trainer.max_epochs=1")
    train(cfg)
    run = Path(cfg.paths.output_dir)
    first = read_attention_health(run / HEALTH_FILE)
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("AttentionHealth")]
    train(cfg_factory(*common, "trainer.max_epochs=2"))
    rows = read_attention_health(run / HEALTH_FILE)
    assert sorted({r["step"] for r in first}) == [0, 2]
    assert sorted({r["step"] for r in rows}) == [0, 2, 4] and len(rows) == 3 * 2  # 1 layer x 2 heads per check
    # step 2 was measured at the end of the first run and again at the start of the resumed one:
    # the same weights (last.ckpt) and the same images give the same numbers
    assert [r for r in rows if r["step"] <= 2] == first
    assert state["inputs"].shape[0] == 8 and state["inputs"].device.type == "cpu"

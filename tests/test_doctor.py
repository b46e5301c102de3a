"""``scripts/doctor.py`` (vitpipe/tasks/doctor): each check passes on a healthy model and names the bug
injected for it (FAIL on that check, the others unmoved); the command as a user types it; a stored run."""

from __future__ import annotations

import re

import pytest
import tiny_checkpoints as tc
import torch
from conftest import make_cfg
from user_shell import fresh_checkout, run

import vitpipe.nn.attention as attention
from vitpipe import create_model
from vitpipe.errors import ConfigError
from vitpipe.models.captioner import Captioner
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.nn.pos_embed import NoPosEmbed, SinCos2DPosEmbed
from vitpipe.tasks import doctor as doctor_task
from vitpipe.tasks.doctor import encoder, sizes
from vitpipe.tasks.doctor.check import Check, rel

NAMES = ["scale", "positions", "causal", "cross_kv", "heads", "memory"]


def vit(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("vit_micro", num_classes=10, **{"depth": 2, **kw})


def captioner(**kw) -> Captioner:
    torch.manual_seed(0)  # decoder width = encoder width (64): a bug may project the decoder state with kv
    return Captioner(encoder={"name": "vit_micro", "depth": 1}, vocab_size=32, dim=64, depth=2, num_heads=4, max_len=8, **kw)


def statuses(net, **kw) -> dict[str, Check]:
    checks = doctor_task.run_checks(net, **kw)
    assert [c.name for c in checks] == NAMES
    return {c.name: c for c in checks}


def only_failure(checks: dict[str, Check], name: str) -> Check:
    assert [n for n, c in checks.items() if c.failed] == [name], {n: c.line() for n, c in checks.items()}
    return checks[name]


# --------------------------------------------------------------------------- healthy models pass


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"pos_embed": "sincos2d"},
        {"pos_embed": "sincos1d"},
        {"pos_embed": "learned2d"},
        {"pos_embed": "rope2d"},
        {"pos_embed": "none"},
        {"pos_embed": "none", "class_token": False, "pool": "mean"},
        {"pos_embed": "none", "rel_pos": "bias"},
        {"reg_tokens": 2},
        {"qk_norm": True},
        {"attn_norm": True},  # the reference applies the heads' output LayerNorm too (scale failed without)
        {"rope": True, "mlp": "swiglu", "mlp_norm": True, "attn_norm": True},  # EVA-02 from timm's zoo
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "learned",
)
def test_a_healthy_vit_passes_and_the_decoder_checks_are_skipped(kw):
    checks = statuses(vit(**kw))
    assert {n: c.status for n, c in checks.items()} == {
        "scale": "PASS",
        "positions": "PASS",
        "causal": "SKIP",
        "cross_kv": "SKIP",
        "heads": "PASS",
        "memory": "PASS",
    }
    assert checks["scale"].value < 1e-13
    on = kw.get("pos_embed", "learned") != "none" or kw.get("rel_pos", "none") != "none"
    assert (checks["positions"].value > 1e-6) if on else (checks["positions"].value < 1e-13)
    assert "image classifier" in checks["causal"].measured


@pytest.mark.parametrize("decoder", ["cross", "prefix"])
def test_a_healthy_captioner_passes(decoder):
    checks = statuses(captioner(decoder=decoder))
    expected = {n: "PASS" for n in NAMES} | ({"cross_kv": "SKIP"} if decoder == "prefix" else {})
    assert {n: c.status for n, c in checks.items()} == expected
    assert checks["causal"].value < 1e-13
    if decoder == "cross":
        assert checks["cross_kv"].value == 0.0  # the very tensors, every step


def test_the_scale_reference_is_the_textbook_formula():
    """reference_attention(scale=1/sqrt(d)) is nn.MultiheadAttention's answer for the same weights."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).double().eval()
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True).double().eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(attn.qkv.weight)
        ref.in_proj_bias.copy_(attn.qkv.bias)
        ref.out_proj.weight.copy_(attn.proj.weight)
        ref.out_proj.bias.copy_(attn.proj.bias)
        x = torch.randn(2, 7, 32, dtype=torch.float64) * 5
        mine = encoder.reference_attention(attn, x, scale=8**-0.5)
        assert torch.allclose(mine, ref(x, x, x, need_weights=False)[0], atol=1e-12)
        assert rel(encoder.reference_attention(attn, x, scale=1.0), mine) > 0.05


# --------------------------------------------------------------------------- 1. scale


def test_an_unscaled_core_fails_scale(monkeypatch):
    net = vit()
    for m in net.modules():
        if isinstance(m, MultiHeadAttention):
            monkeypatch.setattr(m, "scale", 1.0)  # the core hands self.scale to SDPA and to the explicit path
    check = only_failure(statuses(net), "scale")
    assert check.value > 0.1
    assert "no 1/sqrt(d_k)" in check.problem and "vitpipe/nn/attention.py" in check.problem


def test_an_unscaled_fused_path_alone_fails_scale(monkeypatch):
    sdpa = attention.F.scaled_dot_product_attention

    def unscaled(q, k, v, **kw):
        return sdpa(q, k, v, **{**kw, "scale": 1.0})

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", unscaled)
    check = only_failure(statuses(vit()), "scale")
    assert re.search(r"blocks\.\d+\.attn \(fused\) computes softmax\(q k\^T\) v with no 1/sqrt", check.problem)


# --------------------------------------------------------------------------- 2. positions


def test_positions_never_added_fail_positions(monkeypatch):
    monkeypatch.setattr(SinCos2DPosEmbed, "forward", lambda self, x, grid_size: x)
    check = only_failure(statuses(vit(pos_embed="sincos2d")), "positions")
    assert check.value < 1e-13
    assert "pos_embed=sincos2d" in check.problem and "positions never reach the tokens" in check.problem


def test_rope_phases_never_applied_fail_positions(monkeypatch):
    monkeypatch.setattr(attention, "apply_rope", lambda t, cos, sin: t)
    check = only_failure(statuses(vit(pos_embed="rope2d")), "positions")
    assert "rope" in check.problem


def test_positions_where_none_are_configured_fail_positions(monkeypatch):
    def ramp(self, x, grid_size):  # a position-dependent term nothing configured (not constant over channels:
        along = torch.linspace(0, 1, x.shape[1], dtype=x.dtype)  # LayerNorm would remove that)
        return x + along[None, :, None] * torch.linspace(-1, 1, x.shape[2], dtype=x.dtype)

    monkeypatch.setattr(NoPosEmbed, "forward", ramp)
    check = only_failure(statuses(vit(pos_embed="none", class_token=False, pool="mean")), "positions")
    assert check.value > 1e-6 and "nothing positional is configured" in check.problem


def test_the_shuffle_permutes_patch_tokens():
    x = torch.arange(2 * 3 * 8 * 12, dtype=torch.float64).reshape(2, 3, 8, 12)
    perm = torch.tensor([5, 0, 1, 2, 3, 4])  # a 2 x 3 grid of 4x4 patches
    y = encoder.shuffle_patches(x, (4, 4), perm)
    for i, j in enumerate(perm.tolist()):
        (r, c), (r0, c0) = divmod(i, 3), divmod(j, 3)
        assert torch.equal(y[..., 4 * r : 4 * r + 4, 4 * c : 4 * c + 4], x[..., 4 * r0 : 4 * r0 + 4, 4 * c0 : 4 * c0 + 4])


# --------------------------------------------------------------------------- 3. causal


def test_a_causal_mask_built_for_the_full_length_fails_causal(monkeypatch):
    """The mask of the longest sequence, sliced top-left: right for the full pass (SDPA's own flag there),
    misaligned once the KV cache makes queries the last rows."""
    full = torch.ones(8, 8, dtype=torch.bool).tril()
    monkeypatch.setattr(attention, "causal_mask", lambda n_q, n_k, device=None: full[:n_q, :n_k].to(device))
    check = only_failure(statuses(captioner()), "causal")
    assert "moves earlier logits by 0.0e+00" in check.measured  # the full pass is right
    assert "with the KV cache" in check.problem and "causal_mask" in check.problem


def test_a_decoder_that_sees_future_words_fails_causal(monkeypatch):
    attend = MultiHeadAttention._attend

    def no_mask(self, q, k, v, attn_mask, attn_bias, key_padding_mask, is_causal, *rest):
        return attend(self, q, k, v, attn_mask, attn_bias, key_padding_mask, False, *rest)

    monkeypatch.setattr(MultiHeadAttention, "_attend", no_mask)
    check = only_failure(statuses(captioner()), "causal")
    assert "future tokens leak" in check.problem and check.value > 1e-6


# --------------------------------------------------------------------------- 4. cross-attention keys/values


def test_cross_kv_projected_from_the_decoder_state_fails_cross_kv(monkeypatch):
    def from_x(self, x, context, cache):
        q = self._heads(self.q(x), 1)[0]
        k, v = self._heads(self.kv(x), 2)  # the bug: the words, not the image
        return (q, k, v) if cache is None else (q, *cache.append(k, v))

    monkeypatch.setattr(MultiHeadAttention, "_cross_qkv", from_x)
    checks = statuses(captioner())
    assert checks["cross_kv"].failed and "computed from the decoder state" in checks["cross_kv"].problem
    assert checks["causal"].failed  # the full pass now reads later words through cross-attention, too


def test_cross_kv_that_ignore_the_cache_fail_cross_kv(monkeypatch):
    def uncached(self, x, context, cache):
        q = self._heads(self.q(x), 1)[0]
        k, v = self._heads(self.kv(context), 2)  # projected again every step; the cache stays empty
        return q, self.k_norm(k), v

    monkeypatch.setattr(MultiHeadAttention, "_cross_qkv", uncached)
    check = only_failure(statuses(captioner()), "cross_kv")
    assert "caches hold block 0: 0" in check.problem and "once" in check.problem


# --------------------------------------------------------------------------- 5. heads


@pytest.mark.parametrize(
    ("dim", "heads", "says"),
    [
        (64, 5, "encoder dim 64 is not divisible by num_heads=5; num_heads=1 gives head dim 64"),
        (64, 16, "encoder head dim 4 is outside 16..256"),
        (1024, 2, "encoder head dim 512 is outside 16..256"),
    ],
)
def test_bad_head_arithmetic_fails_heads(dim, heads, says):
    check = sizes.check_heads([("encoder", dim, heads)])
    assert check.failed and says in check.problem
    assert check.value == pytest.approx(dim / heads)


def test_a_built_model_with_tiny_heads_fails_heads_only():
    check = only_failure(statuses(vit(num_heads=16)), "heads")
    assert check.measured == "encoder 64 / 16 heads = head dim 4"
    assert "num_heads=1 gives head dim 64" in check.problem
    assert sizes.usual_heads(768) == 12 and sizes.usual_heads(384) == 6


# --------------------------------------------------------------------------- 6. memory


def test_memory_is_the_explicit_matrices_against_what_is_available(monkeypatch):
    net = vit()  # depth 2, 4 heads, 64 patches + class token
    assert sizes.explicit_attention(net, 8)[0][1] == 8 * 4 * 65 * 65 * 4 * 2
    checks = statuses(net, batch_size=8)
    assert checks["memory"].value == 8 * 4 * 65 * 65 * 4 * 2
    assert checks["memory"].measured.startswith(
        "explicit attention (need_weights, rollout) holds 1.0 MiB (encoder 8 x 4 heads x 65 x 65 x 4 B x 2 layers, float32) of "
    )
    monkeypatch.setattr(sizes, "available_memory", lambda device: (100_000, "RAM available"))
    check = only_failure(statuses(vit(), batch_size=8), "memory")
    assert "do not fit" in check.problem and "97.7 KiB RAM available" in check.measured


# --------------------------------------------------------------------------- the command


def doctor_cfg(tmp_path, *overrides: str):
    return make_cfg(tmp_path, list(overrides), config_name="doctor")


def test_a_model_config_is_checked_and_a_failure_exits_1(tmp_path, capsys):
    checks = doctor_task.doctor(doctor_cfg(tmp_path, "model=vit_nano"))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("vitpipe doctor: model=vit_nano: ViT dim 64, depth 4, 4 heads, 8x8 px in 2x2 patches")
    assert [ln.split()[:2] for ln in out[1:7]] == [[n, c.status] for n, c in zip(NAMES, checks)]
    assert out[-1] == "doctor: 4 passed, 0 failed, 2 skipped"
    with pytest.raises(SystemExit) as stop:
        doctor_task.main(doctor_cfg(tmp_path, "model=vit_nano", "model.num_heads=3"))
    assert stop.value.code == doctor_task.EXIT_FAILED
    out = capsys.readouterr().out
    assert "heads     FAIL  encoder 64 / 3 heads = 21.3. encoder dim 64 is not divisible by num_heads=3" in out
    assert out.count("SKIP  the model cannot be built") == 5


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ([], "doctor needs a model: pass ckpt_path=<a .ckpt file, a run directory or `last`> or model=<one of captioner, "),
        (["model=vit_nano", "ckpt_path=x.ckpt"], "ckpt_path=x.ckpt and model=vit_nano: pass one of them"),
        (["ckpt_path=x.ckpt", "data=digits"], "data=DigitsDataModule goes with model="),
        (["model=vit_nano", "batch_size=0"], "batch_size=0: expected null (the run's data.batch_size) or an int >= 1"),
        (["model=vit_nano", "device=tpu"], "device='tpu' is not available here; use auto, cpu"),
        (["model=vit_nano", "seed=-1"], "seed=-1 must be an integer"),
    ],
)
def test_mistakes_are_one_line_before_anything_loads(tmp_path, monkeypatch, overrides, says):
    monkeypatch.setattr(doctor_task, "rebuild", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr(doctor_task, "instantiate_checked", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(ConfigError) as err:
        doctor_task.doctor(doctor_cfg(tmp_path, *overrides))
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_the_command_as_typed(tmp_path):
    """`python scripts/doctor.py model=vit_micro` from a fresh directory: six lines and exit status 0."""
    done = run("python scripts/doctor.py model=vit_micro", fresh_checkout(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("vitpipe doctor: model=vit_micro: ViT dim 64, depth 4, 4 heads, 32x32 px")
    assert [ln.split()[:2] for ln in lines[1:7]] == [
        ["scale", "PASS"],
        ["positions", "PASS"],
        ["causal", "SKIP"],
        ["cross_kv", "SKIP"],
        ["heads", "PASS"],
        ["memory", "PASS"],
    ]
    assert re.search(
        r"^positions PASS  shuffling the 64 patches changes the pooled features \(pool=cls\) by [\d.e-]+ "
        r"\(pos_embed=learned: must change\)$",
        lines[2],
    )
    assert lines[-1] == "doctor: 4 passed, 0 failed, 2 skipped"


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    return lambda kind: tc.checkpoint(kind, base)


def test_a_stored_classifier_run(ckpts, tmp_path, capsys):
    ckpt = ckpts("rope2d")
    checks = doctor_task.doctor(doctor_cfg(tmp_path, f"ckpt_path={ckpt.parent.parent}"))
    out = capsys.readouterr().out
    assert out.startswith(
        f"vitpipe doctor: {ckpt}: ViT dim 32, depth 1, 2 heads, 8x8 px in 2x2 patches (16 + 1 tokens), pos_embed=rope2d, pool=cls"
    )
    assert [c.status for c in checks] == ["PASS", "PASS", "SKIP", "SKIP", "PASS", "PASS"]
    assert "(encoder 16 x 2 heads x 17 x 17 x 4 B x 1 layers" in out  # the run's data.batch_size


def test_a_stored_captioner_run(ckpts, tmp_path, capsys):
    checks = doctor_task.doctor(doctor_cfg(tmp_path, f"ckpt_path={ckpts('captioner')}"))
    out = capsys.readouterr().out
    assert [c.status for c in checks] == ["PASS"] * 6, out
    assert "Captioner decoder=cross" in out and "cross_kv  PASS  keys/values move by 0.0e+00" in out


def test_a_network_without_vitpipe_attention_is_refused_in_one_line(tmp_path_factory, tmp_path):
    ckpt = tc.timm_checkpoint(tmp_path_factory.mktemp("timm"))  # model=timm: a ResNet
    with pytest.raises(ConfigError) as err:
        doctor_task.doctor(doctor_cfg(tmp_path, f"ckpt_path={ckpt}"))
    assert str(err.value) == f"{ckpt} is a ResNet; doctor checks vitpipe's attention: a ViT classifier or a Captioner"

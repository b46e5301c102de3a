"""FlexiViT (Beyer et al. 2023): PI-resize of the patch kernel, random patch sizes in training,
inference at any patch size, the state_dict unchanged, eval's model_patch_size, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_cfg
from timm.layers import resample_patch_embed

from vitpipe import create_model
from vitpipe.errors import ConfigError
from vitpipe.nn.patch_embed import PatchEmbed, pi_resize, resize_matrix


def _resize_each_patch(x: torch.Tensor, p: int, new: tuple[int, int]) -> torch.Tensor:
    """Images (B, C, h*p, w*p) -> (B, C, h*new_h, w*new_w): every p x p patch resized on its own
    (bicubic, antialiased: the resize the PI-resize inverts), as FlexiViT's section 3.4 states the property."""
    B, C, H, W = x.shape
    h, w = H // p, W // p
    patches = x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(B * h * w, C, p, p)
    up = F.interpolate(patches, size=new, mode="bicubic", antialias=True, align_corners=False)  # (B*h*w, C, *new)
    up = up.reshape(B, h, w, C, *new).permute(0, 3, 1, 4, 2, 5)  # (B, C, h, new_h, w, new_w)
    return up.reshape(B, C, h * new[0], w * new[1])


def _model(**kw):
    base = {"img_size": 16, "patch_size": 4, "in_chans": 1, "num_classes": 4, "dim": 32, "depth": 1, "num_heads": 2}
    return create_model("vit_micro", **{**base, **kw})


# ---------------------------------------------------------------- PI-resize


@pytest.mark.parametrize("new", [(4, 4), (5, 5), (6, 6), (8, 8), (12, 12), (6, 8)])
def test_pi_resized_kernel_gives_the_original_tokens_on_the_resized_input(new):
    """<resize(x), PI-resize(w)> = <x, w> for every patch: the tokens of an input whose patches are
    upsampled to ``new`` with the resized kernel equal the original input's with the original kernel."""
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=8, patch_size=4, in_chans=3, dim=16).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    tokens, grid = embed(x)
    big = _resize_each_patch(x, 4, new)
    tokens_new, grid_new = embed(big, patch_size=new)
    assert grid == grid_new == (2, 2)
    assert (tokens - tokens_new).abs().max().item() < 1e-5
    if new != (4, 4):  # the property is the PI-resize's: a plainly interpolated kernel breaks it
        naive = F.interpolate(embed.proj.weight, size=new, mode="bicubic", align_corners=False)
        naive_tokens = F.conv2d(big, naive, embed.proj.bias, stride=new).flatten(2).transpose(1, 2)
        assert (tokens - naive_tokens).abs().max().item() > 1e-2


@pytest.mark.parametrize("new", [(2, 2), (3, 3), (6, 6), (8, 8), (16, 16), (3, 7)])
def test_pi_resize_matches_timm_resample_patch_embed(new):
    torch.manual_seed(0)
    w = torch.randn(8, 3, 4, 4)
    ours, timms = pi_resize(w, new), resample_patch_embed(w, list(new))
    assert ours.shape == timms.shape == (8, 3, *new)
    assert (ours - timms).abs().max().item() < 1e-5 * max(1.0, timms.abs().max().item())


def test_resize_matrix_is_the_resize_and_gradients_reach_the_stored_kernel():
    torch.manual_seed(0)
    x = torch.randn(3, 5, dtype=torch.float64)
    B = resize_matrix((3, 5), (7, 4))
    ref = F.interpolate(x[None, None], size=(7, 4), mode="bicubic", antialias=True, align_corners=False)
    assert torch.allclose(B @ x.flatten(), ref.flatten(), atol=1e-12)
    w = torch.randn(4, 2, 3, 3, requires_grad=True)
    pi_resize(w, 5).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


# ---------------------------------------------------------------- the model


def test_state_dict_is_unchanged_by_patch_size_switches():
    torch.manual_seed(0)
    m = _model(flexi_patch_sizes=[2, 4, 8])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(2, 1, 16, 16)
    m.train()
    for _ in range(4):
        m(x)
    m.eval()
    for p in (2, 8, 16, None):
        m.set_patch_size(p)
        m(x)
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == before[k].shape and torch.equal(after[k], before[k]) for k in before)
    assert after["patch_embed.proj.weight"].shape == (32, 1, 4, 4)  # the built patch size

    plain = _model()  # the same weights without FlexiViT: strict load, the same logits at patch_size
    plain.load_state_dict(after)
    plain.eval()
    assert torch.equal(plain(x), m(x))
    at_4 = m(x)
    m.set_patch_size(8)
    plain.set_patch_size(8)  # any ViT runs at another patch size, trained for it or not
    assert torch.equal(plain(x), m(x))
    assert not torch.allclose(m(x), at_4, atol=1e-4)  # and it did embed at 8


def _sizes_drawn(m, x, n: int) -> list[int]:
    """The patch side of each of n training forwards, read off the token count (B, 1 + (16/p)^2, dim)."""
    return [16 // round((m.forward_features(x).shape[1] - 1) ** 0.5) for _ in range(n)]


def test_training_draws_sizes_from_the_global_generator_so_resume_repeats_them():
    m = _model(flexi_patch_sizes=[2, 4, 8]).train()
    x = torch.randn(1, 1, 16, 16)
    torch.manual_seed(123)
    drawn = _sizes_drawn(m, x, 30)
    assert set(drawn) == {2, 4, 8}
    torch.manual_seed(123)  # the documented draw: one torch.randint per forward, uniform over the list
    assert drawn == [(2, 4, 8)[int(torch.randint(3, ()))] for _ in range(30)]
    torch.manual_seed(7)
    _sizes_drawn(m, x, 5)
    state = torch.get_rng_state()  # what vitpipe's checkpoints keep (vitpipe.data.resume.rng_state)
    rest = _sizes_drawn(m, x, 10)
    torch.set_rng_state(state)
    assert _sizes_drawn(m, x, 10) == rest
    m.eval()  # eval: patch_size, or set_patch_size's, no draw
    assert _sizes_drawn(m, x, 3) == [4, 4, 4]
    m.set_patch_size(2)
    assert _sizes_drawn(m, x, 3) == [2, 2, 2] and m.current_patch_size == (2, 2)


def _quadrant_task(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16x16 noise with one bright quadrant; the label is which (chance: 25%)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(4, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 16, 16, generator=g)
    for i, k in enumerate(y.tolist()):
        r, c = divmod(k, 2)
        x[i, 0, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] += 1.0
    return x, y


def test_model_trained_at_random_patch_sizes_is_accurate_at_each():
    torch.manual_seed(0)
    m = _model(flexi_patch_sizes=[2, 4, 8], pool="mean", class_token=False)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x, y = _quadrant_task(512, seed=0)
    m.train()
    for step in range(200):  # ~1.5 s on 2 CPU cores
        i = torch.arange(step * 32, step * 32 + 32) % 512
        loss = F.cross_entropy(m(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    xt, yt = _quadrant_task(256, seed=1)
    m.eval()
    for p in (2, 4, 8):
        m.set_patch_size(p)
        with torch.no_grad():
            logits = m(xt)
        acc = (logits.argmax(1) == yt).float().mean().item()
        assert torch.isfinite(logits).all()
        assert acc > 0.9, (p, acc)  # chance is 0.25


# ---------------------------------------------------------------- one-line errors


DIVISORS = "1, 2, 4, 8, 16"  # of img_size 16
LIST_HINT = f"; use null or a list of patch sizes dividing img_size 16x16: {DIVISORS}"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"flexi_patch_sizes": [2, 5]}, f"flexi_patch_sizes: 5 does not divide img_size 16x16; valid patch sizes: {DIVISORS}"),
    ({"flexi_patch_sizes": []}, f"flexi_patch_sizes=[]{LIST_HINT}"),
    ({"flexi_patch_sizes": [2, 0]}, f"flexi_patch_sizes=[2, 0]{LIST_HINT}"),
    ({"flexi_patch_sizes": [2], "stem": "conv"},
     "flexi_patch_sizes needs stem='patch' (the conv stem cannot change its patch), got stem='conv'"),
])
def test_bad_flexi_patch_sizes_are_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        _model(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("bad", [5, 0, -4, "8", True, (4, 3)])
def test_bad_patch_size_for_inference_is_one_line(bad):
    with pytest.raises(ValueError) as err:
        _model().set_patch_size(bad)
    assert str(err.value) == f"patch size {bad!r} does not divide img_size 16x16; valid patch sizes: {DIVISORS}"


def test_conv_stem_refuses_another_patch_size_in_one_line():
    m = _model(stem="conv")
    m.set_patch_size(4)  # its own size is fine
    with pytest.raises(ValueError, match=r"^stem='conv' embeds at its built patch 4 only, got patch size 8; "):
        m.set_patch_size(8)


def test_pos_embed_ar_preserving_reaches_the_learned_tables():
    assert _model().pos_embed.ar_preserving is True  # the default: timm NaFlexVit's par resampling, as before
    assert _model(pos_embed_ar_preserving=False).pos_embed.ar_preserving is False
    assert _model(pos_embed="learned2d", pos_embed_ar_preserving=False).pos_embed.ar_preserving is False


# ---------------------------------------------------------------- train and eval through the entry points


@pytest.fixture(scope="module")
def flexi_run(tmp_path_factory):
    """A debug=fast train() run of vit_nano (8x8 digits, patch 2) at random patch sizes 2 and 4."""
    from vitpipe.tasks.train import train

    tmp = tmp_path_factory.mktemp("flexi")
    cfg = make_cfg(tmp, ["debug=fast", "logger=none", "model.flexi_patch_sizes=[2,4]"])
    train(cfg)
    return next((Path(cfg.paths.output_dir) / "checkpoints").glob("epoch_*.ckpt"))


def test_eval_at_another_patch_size(flexi_run, tmp_path):
    from vitpipe.tasks.evaluate import evaluate

    def scores(*extra):
        cfg = make_cfg(tmp_path / str(len(extra)) / "_".join(extra), [f"ckpt_path={flexi_run}", *extra],
                       config_name="eval")
        return evaluate(cfg)

    trained, same, other = scores(), scores("model_patch_size=2"), scores("model_patch_size=4")
    assert same == trained  # the built patch size is the default
    assert all(torch.isfinite(torch.tensor(v)) for v in other.values())
    assert other["test/loss"] != trained["test/loss"]  # it did embed at 4
    with pytest.raises(ConfigError) as err:
        scores("model_patch_size=3")
    assert str(err.value) == "model_patch_size=3: patch size 3 does not divide img_size 8x8; valid patch sizes: 1, 2, 4, 8"


EVAL_HINT = "; use null (the trained patch size) or a positive integer dividing the model's img_size"


@pytest.mark.parametrize(("value", "message"), [("0", f"model_patch_size=0{EVAL_HINT}"),
                                                ("abc", f"model_patch_size='abc'{EVAL_HINT}")])
def test_bad_model_patch_size_is_refused_before_the_checkpoint_is_read(tmp_path, value, message):
    from vitpipe.tasks.evaluate import evaluate

    cfg = make_cfg(tmp_path, [f"ckpt_path={tmp_path / 'missing.ckpt'}", f"model_patch_size={value}"], config_name="eval")
    with pytest.raises(ConfigError) as err:
        evaluate(cfg)
    assert str(err.value) == message

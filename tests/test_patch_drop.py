"""model.patch_drop_rate: training on a random subset of the patch tokens (PatchDropout, Liu et al. 2023),
timm's module where timm's VisionTransformer puts it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from timm.models.vision_transformer import VisionTransformer

from vitpipe.lit.optim import build_optimizer
from vitpipe.models.timm_compat import from_timm, timm_kwargs, to_timm
from vitpipe.models.vit import ViT

TIMM = dict(img_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=4, num_classes=10, reg_tokens=2,
            patch_drop_rate=0.5)
SMALL = dict(img_size=16, patch_size=4, in_chans=3, num_classes=5, dim=32, depth=2, num_heads=2)


def _random_timm(**kw):
    torch.manual_seed(0)
    tm = VisionTransformer(**{**TIMM, **kw}).eval()
    with torch.no_grad():  # default init leaves biases at 0 and tokens ~0: randomise so every weight matters
        for p in tm.parameters():
            p.normal_(std=0.2)
    return tm


def _tokens_into_first_block(model, x) -> torch.Tensor:
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(args[0].detach()))
    try:
        model(x)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_eval_logits_equal_timm_and_the_rate_converts_both_ways(global_pool):
    kw = {} if global_pool == "token" else dict(global_pool="avg", class_token=False, reg_tokens=0)
    tm = _random_timm(**kw)
    m = from_timm(tm)
    assert m.patch_drop_rate == 0.5 and not m.training
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(m(x), tm(x), atol=1e-6, rtol=0)
    assert timm_kwargs(m)["patch_drop_rate"] == 0.5
    back = to_timm(m, "vit_small_patch16_224")
    assert back.patch_drop.prob == 0.5 and back.patch_drop.num_prefix_tokens == tm.num_prefix_tokens


def test_train_mode_keeps_the_tokens_timm_keeps():
    """Same weights, same torch RNG state: timm's and vitpipe's training forwards keep the same tokens."""
    tm = _random_timm()
    m = from_timm(tm).train()
    tm.train()
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(7)
    ours = m(x)
    torch.manual_seed(7)
    theirs = tm(x)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(ours, m.eval()(x), atol=1e-3)  # tokens were dropped


@pytest.mark.parametrize("rate", [0.25, 0.5, 0.9])
@pytest.mark.parametrize("prefix", [dict(), dict(reg_tokens=2), dict(class_token=False, pool="mean")])
def test_train_mode_feeds_prefix_plus_the_kept_fraction_of_patches(rate, prefix):
    torch.manual_seed(0)
    m = ViT(**SMALL, patch_drop_rate=rate, **prefix)
    with torch.no_grad():
        for t in (m.cls_token, m.reg_token):
            if t is not None:
                t.normal_()  # distinct prefix tokens, to check they pass unchanged
    x = torch.randn(4, 3, 16, 16)
    P, n = m.num_prefix_tokens, 16
    m.eval()
    full = _tokens_into_first_block(m, x)  # eval: identity, all tokens
    assert full.shape[1] == P + n
    m.train()
    kept = _tokens_into_first_block(m, x)
    assert kept.shape[1] == P + max(1, int(n * (1 - rate)))  # timm's count
    assert torch.equal(kept[:, :P], full[:, :P])  # prefix tokens kept, first, unchanged
    # every kept patch token is one of the image's own (positions added before the drop), each at most once
    patches = full[:, P:]
    for b in range(x.shape[0]):
        match = (kept[b, P:, None] == patches[b, None]).all(-1)  # (kept, n)
        assert (match.sum(1) == 1).all() and (match.sum(0) <= 1).all()


def test_eval_forward_and_attention_maps_are_the_models_without_drop():
    torch.manual_seed(0)
    plain = ViT(**SMALL)
    dropped = ViT(**SMALL, patch_drop_rate=0.5)
    dropped.load_state_dict(plain.state_dict())  # no parameters or buffers of its own
    plain.eval(), dropped.eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(plain(x), dropped(x))
        t0, a0 = plain.forward_features(x, return_attn=True)
        t1, a1 = dropped.forward_features(x, return_attn=True)
    assert torch.equal(t0, t1) and all(torch.equal(a, b) for a, b in zip(a0, a1, strict=True))
    assert a1[0].shape[-1] == dropped.num_tokens


@pytest.mark.parametrize("kw, words", [
    (dict(patch_drop_rate=1.0), "patch_drop_rate=1.0; use a fraction in [0, 1)"),
    (dict(patch_drop_rate=-0.1), "patch_drop_rate=-0.1; use a fraction in [0, 1)"),
    (dict(patch_drop_rate=True), "patch_drop_rate=True"),
    (dict(patch_drop_rate=0.5, pos_embed="rope2d"), "patch_drop_rate=0.5 with pos_embed='rope2d'"),
    (dict(patch_drop_rate=0.5, rel_pos="bias"), "patch_drop_rate=0.5 with rel_pos='bias'"),
    (dict(patch_drop_rate=0.5, attn_window=1), "patch_drop_rate=0.5 with attn_window=1"),
])
def test_refusals_are_one_line_naming_the_value(kw, words):
    with pytest.raises(ValueError) as e:
        ViT(**SMALL, **kw)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_naflex_dicts_are_refused_in_training_only():
    from vitpipe.nn.naflex import pad_batch, patchify_image

    m = ViT(**SMALL, patch_drop_rate=0.5)
    batch = pad_batch([patchify_image(torch.randn(3, 16, 8), 4, 16), patchify_image(torch.randn(3, 8, 16), 4, 16)])
    with pytest.raises(ValueError, match=r"^patch_drop_rate=0.5 takes image tensors") as e:
        m.train()(batch)
    assert "\n" not in str(e.value)
    assert m.eval()(batch).shape == (2, 5)


def test_config_override_trains_a_step_with_finite_loss_and_gradients(cfg_factory):
    """`model.patch_drop_rate=0.5` as the user types it: the composed model and the recipe's optimizer."""
    cfg = cfg_factory("model.patch_drop_rate=0.5")
    net = instantiate(cfg.model).train()
    assert net.patch_drop_rate == 0.5
    opt = build_optimizer(instantiate(cfg.module.optimizer), net)
    torch.manual_seed(0)
    size = net.img_size
    x, y = torch.randn(8, net.in_chans, *size), torch.randint(0, net.num_classes, (8,))
    before = [p.detach().clone() for p in net.parameters()]
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    assert math.isfinite(loss.item())
    grads = [p.grad for p in net.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert net.patch_embed.proj.weight.grad.abs().sum() > 0  # through the kept tokens to the stem
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))

"""model.tome_r: Token Merging at inference (Bolya et al. 2023), vitpipe.nn.tome and the ViT's use of it."""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from vitpipe.errors import ConfigError
from vitpipe.models.vit import ViT
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.nn.tome import TokenMerger, bipartite_soft_matching, max_merge, merge_sum, merge_wavg
from vitpipe.viz.rollout import gradient_rollout, rollout_for_model

SMALL = dict(img_size=16, patch_size=2, in_chans=3, num_classes=5, dim=32, depth=4, num_heads=2)  # 64 patches
PREFIXES = {"cls": dict(), "cls+dist+reg": dict(dist_token=True, reg_tokens=2),
            "mean": dict(class_token=False, pool="mean")}


def _model(r: int = 0, **kw) -> ViT:
    torch.manual_seed(0)
    m = ViT(**{**SMALL, **kw}, tome_r=r).eval()
    with torch.no_grad():  # prefix tokens start at ~0: make them distinct, so their rows are recognisable
        for t in (m.cls_token, m.dist_token, m.reg_token):
            if t is not None:
                t.normal_()
    return m


def _per_block(model: ViT, x: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """(tokens, sizes, source) after each block of a ``forward_merged(trace_source=True)``."""
    seen = []

    def hook(mod, args, kwargs, out):
        merger = kwargs["merge"]
        seen.append((out.shape[1], merger.size.clone(), merger.source.clone()))

    handles = [blk.register_forward_hook(hook, with_kwargs=True) for blk in model.blocks]
    try:
        with torch.no_grad():
            model.forward_merged(x, trace_source=True)
    finally:
        for h in handles:
            h.remove()
    return seen


# --------------------------------------------------------------------------- the matching


def test_matching_merges_the_most_similar_pairs_and_never_the_prefix():
    # prefix 1; patches p0..p5: A = p0, p2, p4, B = p1, p3, p5. p4 is p1's twin, p0 close to p5
    e = torch.eye(4)
    patches = torch.stack([e[0] + 0.1 * e[1], e[1], e[2], e[3], e[1], e[0]])
    metric = torch.cat([e[1][None] * 5, patches])[None]  # the prefix token equals p1's direction too
    m = bipartite_soft_matching(metric, 1, num_prefix=1)
    assert m.src.tolist() == [[2]] and m.dst.tolist() == [[0]]  # A[2] = p4 into B[0] = p1
    m = bipartite_soft_matching(metric, 2, num_prefix=1)
    assert m.src.tolist() == [[2, 0]] and m.dst.tolist() == [[0, 2]] and m.keep.tolist() == [[1]]
    x = torch.arange(7.0)[None, :, None]  # token i holds value i
    merged, size = merge_wavg(x, torch.ones(1, 7, 1), m)
    # prefix, kept A (p2), B: p1 + p4, p3, p5 + p0
    assert merged[0, :, 0].tolist() == [0.0, 3.0, (2 + 5) / 2, 4.0, (6 + 1) / 2]
    assert size[0, :, 0].tolist() == [1.0, 1.0, 2.0, 1.0, 2.0]


@pytest.mark.parametrize("n, prefix", [(9, 1), (10, 0), (2, 3), (1, 1)])
def test_r_is_bounded_by_half_the_patches(n, prefix):
    metric = torch.randn(2, prefix + n, 8)
    m = bipartite_soft_matching(metric, 100, num_prefix=prefix)
    assert max_merge(prefix + n, prefix) == n // 2
    assert (m is None) == (n // 2 == 0)
    if m is not None:
        assert m.r == n // 2 and merge_sum(metric, m).shape[1] == prefix + n - n // 2


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("prefix", PREFIXES)
def test_r0_is_the_plain_model_bitwise_and_training_is_unchanged(prefix):
    plain, tome = _model(0, **PREFIXES[prefix]), _model(8, **PREFIXES[prefix])
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        ref = plain(x)
        assert not torch.allclose(tome(x), ref, atol=1e-6)  # merging changes something
        tome.set_tome_r(0)
        assert torch.equal(tome(x), ref)
        tome.set_tome_r(8)
        plain.train(), tome.train()  # training ignores tome_r (no dropout here: a deterministic forward)
        assert torch.equal(tome(x), plain(x))


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("r", [5, 32])
def test_sizes_source_and_token_counts_after_every_block(prefix, r):
    model = _model(r, **PREFIXES[prefix])
    P, n0 = model.num_prefix_tokens, 64
    N0 = P + n0
    x = torch.randn(2, 3, 16, 16)
    n, expected = n0, []
    for _ in model.blocks:  # r per block, bounded by half the patches left (the algorithm's bound)
        n -= min(r, n // 2)
        expected.append(P + n)
    trace = _per_block(model, x)
    assert [t for t, _, _ in trace] == expected
    if r == 5:
        assert expected[-1] == N0 - len(model.blocks) * r  # N - L*r while the bound does not bite
    for tokens, size, source in trace:
        assert size.shape == (2, tokens, 1) and source.shape == (2, tokens, N0)
        assert torch.equal(size.sum(dim=(1, 2)), torch.full((2,), float(N0)))  # sizes sum to prefix + patches
        assert ((source == 0) | (source == 1)).all()
        assert torch.equal(source.sum(dim=1), torch.ones(2, N0))  # each input token in exactly one token
        assert torch.equal(source.sum(dim=2, keepdim=True), size)  # a token's size: the inputs it holds
        assert torch.equal(source[:, :P], torch.eye(P, N0).expand(2, P, N0))  # prefix: never merged, first


@pytest.mark.parametrize("prefix", PREFIXES)
def test_prefix_tokens_pass_through_as_in_the_model_without_merging_until_attention_differs(prefix):
    """Prefix tokens are never merged: after block 1 (all sizes 1 in its attention) they equal the plain model's."""
    plain, tome = _model(0, **PREFIXES[prefix]), _model(16, **PREFIXES[prefix])
    x = torch.randn(2, 3, 16, 16)
    P = plain.num_prefix_tokens
    outs = {}
    for name, model in (("plain", plain), ("tome", tome)):
        h = model.blocks[0].register_forward_hook(lambda mod, a, out, name=name: outs.__setitem__(name, out))
        with torch.no_grad():
            model(x)
        h.remove()
    assert outs["tome"].shape[1] == P + 48 and torch.equal(outs["tome"][:, :P], outs["plain"][:, :P])


def test_proportional_attention_reproduces_duplicated_tokens_exactly():
    """If token j duplicates token i, merging them and adding log 2 to the merged key's logit gives every
    query the output it had before: exp(s) + exp(s) = exp(s + log 2). In float64, to rounding."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    x[:, 5] = x[:, 2]  # token 5 duplicates token 2
    x[:, 6] = x[:, 4]  # and token 6 token 4
    with torch.no_grad():
        full = attn(x)
        merged = x[:, [0, 1, 2, 3, 4]]
        size = torch.tensor([1.0, 1, 2, 1, 2], dtype=torch.float64)
        out = attn(merged, attn_bias=size.log()[None, None, None])
        no_bias = attn(merged)
    assert torch.allclose(out, full[:, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(no_bias, full[:, :5], atol=1e-6)  # without the bias the duplicates lose weight


@pytest.mark.parametrize("prefix", ["cls", "mean"])
def test_a_model_of_identical_patches_gives_the_plain_logits(prefix):
    """A uniform image without positions: every patch token is the same, so each merge joins duplicates;
    proportional attention and size-weighted pooling then reproduce the unmerged model."""
    plain = _model(0, pos_embed="none", **PREFIXES[prefix]).double()
    tome = _model(16, pos_embed="none", **PREFIXES[prefix]).double()
    x = torch.randn(2, 3, 1, 1, dtype=torch.float64).expand(2, 3, 16, 16)
    with torch.no_grad():
        tokens, merger = tome.forward_merged(x)
        assert tokens.shape[1] < plain.num_tokens  # merged
        assert torch.allclose(tome(x), plain(x), atol=1e-10, rtol=0)


def test_mean_pooling_is_weighted_by_token_size():
    model = _model(16, **PREFIXES["mean"])
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        tokens, merger = model.forward_merged(x)
        w = merger.size  # (B, n, 1): no prefix in this model
        pooled = (tokens * w).sum(1) / w.sum(1)
        assert torch.allclose(model(x), model.head(model.fc_norm(pooled)), atol=1e-6, rtol=0)
        assert not torch.allclose(model(x), model.head(model.fc_norm(tokens.mean(1))), atol=1e-4)


def test_merger_bias_is_log_size_once_tokens_are_merged():
    x = torch.randn(1, 5, 4)
    merger = TokenMerger(x, 2, 1)
    assert merger.attn_bias() is None
    x = merger(x, torch.randn(1, 2, 5, 4))
    assert x.shape[1] == 3 and torch.equal(merger.attn_bias(), merger.size.log().reshape(1, 1, 1, 3))


def test_config_override_builds_a_merging_model(cfg_factory):
    cfg = cfg_factory("model.tome_r=2")
    net = instantiate(cfg.model).eval()
    assert net.tome_r == 2
    with torch.no_grad():
        tokens, merger = net.forward_merged(torch.randn(2, net.in_chans, *net.img_size))
    assert tokens.shape[1] == net.num_tokens - 2 * len(net.blocks)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, words", [
    (dict(tome_r=-1), "tome_r=-1; use an int >= 0"),
    (dict(tome_r=1.5), "tome_r=1.5; use an int >= 0"),
    (dict(tome_r=True), "tome_r=True; use an int >= 0"),
    (dict(tome_r=33), "tome_r=33 is more than a block can merge: 64 patches at img_size 16x16 allow at most tome_r=32"),
    (dict(tome_r=4, pos_embed="rope2d"), "tome_r=4 with pos_embed='rope2d'"),
    (dict(tome_r=4, rel_pos="mlp_swin"), "tome_r=4 with rel_pos='mlp_swin'"),
    (dict(tome_r=4, attn_window=2), "tome_r=4 with attn_window=2"),
])
def test_refusals_are_one_line_naming_the_value(kw, words):
    with pytest.raises(ValueError) as e:
        ViT(**{**SMALL, **kw})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_patch_dicts_attention_maps_and_rollout_are_refused_while_merging():
    from vitpipe.nn.naflex import pad_batch, patchify_image

    model = _model(4)
    batch = pad_batch([patchify_image(torch.randn(3, 16, 8), 2, 64), patchify_image(torch.randn(3, 8, 16), 2, 64)])
    with pytest.raises(ValueError, match=r"^tome_r=4 takes image tensors"):
        model(batch)
    x = torch.randn(1, 3, 16, 16)
    with pytest.raises(ValueError, match=r"^attention maps with tome_r=4: merged tokens change the token count"):
        model.forward_features(x, return_attn=True)
    message = ("attention rollout with model.tome_r>0: merged tokens change the token count per layer; use tome_r=0 "
               "for rollout")
    for explain in (rollout_for_model, gradient_rollout):
        with pytest.raises(ConfigError) as e:
            explain(model, x)
        assert str(e.value) == message
    model.set_tome_r(0)
    assert rollout_for_model(model, x).shape == (1, 8, 8)
    assert model.train().forward_features(x, return_attn=True)[0].shape[1] == model.num_tokens  # training: no merging
    assert math.isfinite(model.eval()(x).sum().item())


def test_timm_export_of_a_merging_model_is_refused_in_one_line():
    """timm's VisionTransformer has no token merging: its logits would be another model's."""
    from vitpipe.models.timm_compat import to_timm

    with pytest.raises(ConfigError, match=r"cannot express token merging \(tome_r=2; timm has no ToMe\)") as e:
        to_timm(_model(2, stem="patch", class_token=True, pool="cls").eval())
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- eval and predict: model_tome_r


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A short train() run of a 2-block vit_nano (8x8 digits, patch 2: 16 patches, so up to 8 merged per block);
    10 steps, so the head is no longer the near-zero of its init (whose logits ignore the tokens)."""
    from pathlib import Path

    from tests.conftest import make_cfg
    from vitpipe.tasks.train import train

    tmp = tmp_path_factory.mktemp("tome_run")
    cfg = make_cfg(tmp, ["debug=fast", "logger=none", "model.depth=2", "trainer.limit_train_batches=10",
                         "trainer.limit_test_batches=4"])
    train(cfg)
    return next((Path(cfg.paths.output_dir) / "checkpoints").glob("epoch_*.ckpt"))


def test_eval_and_predict_merge_tokens_of_a_trained_run(digits_run, tmp_path):
    """eval's model_tome_r=0 is the run as trained, bitwise; r=3 tests the same weights merging 3 tokens per
    block; predict's loader merges as a model built with tome_r=3 does (the same logits)."""
    from tests.conftest import make_cfg
    from vitpipe.inference.load import load_predictor
    from vitpipe.run.checkpoint import rebuild
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.tasks.evaluate import evaluate

    def scores(*extra):
        return evaluate(make_cfg(tmp_path / ("_".join(extra) or "plain"), [f"ckpt_path={digits_run}", *extra],
                                 config_name="eval"))

    plain, off, merged = scores(), scores("model_tome_r=0"), scores("model_tome_r=3")
    assert off == plain
    assert merged["test/loss"] != plain["test/loss"] and math.isfinite(merged["test/loss"])
    loaded = load_predictor(digits_run, tome_r=3)
    assert loaded.net.tome_r == 3
    reference = rebuild(load_checkpoint(digits_run), digits_run).net.eval()
    reference.set_tome_r(3)
    x = torch.randn(4, reference.in_chans, *reference.img_size)
    with torch.no_grad():
        assert torch.equal(loaded.net(x), reference(x))
        reference.set_tome_r(0)
        assert not torch.equal(loaded.net(x), reference(x))
    with pytest.raises(ConfigError, match=r"^model_tome_r=9: tome_r=9 is more than a block can merge"):
        load_predictor(digits_run, tome_r=9)


@pytest.mark.parametrize("config", ["eval", "predict"])
@pytest.mark.parametrize("value", ["-1", "1.5", "abc"])
def test_bad_model_tome_r_is_refused_before_the_checkpoint_is_read(tmp_path, config, value):
    from tests.conftest import make_cfg
    from vitpipe.tasks.evaluate import evaluate
    from vitpipe.tasks.predict import predict

    extra = [f"images={tmp_path}", f"out={tmp_path}/p.csv"] if config == "predict" else []
    cfg = make_cfg(tmp_path, [f"ckpt_path={tmp_path / 'missing.ckpt'}", f"model_tome_r={value}", *extra],
                   config_name=config)
    with pytest.raises(ConfigError) as err:
        (evaluate if config == "eval" else predict)(cfg)
    shown = {"-1": "-1", "1.5": "1.5", "abc": "'abc'"}[value]
    assert str(err.value) == (f"model_tome_r={shown}; use null (the run's own model.tome_r) or an int >= 0 (tokens "
                              "merged per block at inference; 0: off)")

"""Attention rollout, gradient rollout, raw and cross-attention maps.

Known answers are worked out by hand in the comments; a plain-loop reference
(written from Abnar & Zuidema 2020, independent of the vectorised code) covers
the random cases.
"""

import pytest
import torch

from vitpipe.viz.rollout import (
    attention_maps,
    attention_rollout,
    cross_attention_maps,
    gradient_rollout,
    gradient_weighted,
    rollout_for_model,
)

# ----------------------------------------------------------------------------- helpers


def one_hot_rows(targets, n):
    """(N, N) matrix whose row i is one-hot at targets[i]."""
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, j in enumerate(targets):
        w[i, j] = 1.0
    return w


def random_attn(batch, heads, n, *, seed, layers=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, n, generator=g).mul(2).softmax(-1) for _ in range(layers)]


def reference_rollout(attentions, b, *, fusion="mean", prefix=1, query="cls"):
    """Plain loops for batch item b: fuse heads, 0.5 W + 0.5 I, renormalise rows, R = A_L ... A_1."""
    n = attentions[0].shape[-1]
    result = [[float(i == j) for j in range(n)] for i in range(n)]
    for attn in attentions:
        heads = attn[b].double().tolist()
        a = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                vals = [h[i][j] for h in heads]
                w = {"mean": sum(vals) / len(vals), "max": max(vals), "min": min(vals)}[fusion]
                a[i][j] = 0.5 * w + 0.5 * (i == j)
            s = sum(a[i])
            a[i] = [v / s for v in a[i]]
        result = [[sum(a[i][k] * result[k][j] for k in range(n)) for j in range(n)] for i in range(n)]
    if query == "cls":
        return torch.tensor(result[0][prefix:], dtype=torch.float64)
    rows = result[prefix:]
    return torch.tensor([sum(r[j] for r in rows) / len(rows) for j in range(prefix, n)], dtype=torch.float64)


@pytest.fixture
def two_layer():
    """1 class token + 4 patches (2x2 grid), 2 heads, batch 1.

    Layer 1: head a sends every query to token 1 (patch 0); head b is uniform (1/5).
    Layer 2: both heads send the class token to token 3 (patch 2); other tokens to themselves.
    """
    n = 5
    head_a = one_hot_rows([1, 1, 1, 1, 1], n)
    head_b = torch.full((n, n), 0.2, dtype=torch.float64)
    layer1 = torch.stack([head_a, head_b])[None]  # (1, 2, 5, 5)
    layer2 = torch.stack([one_hot_rows([3, 1, 2, 3, 4], n)] * 2)[None]
    return [layer1, layer2]


# ----------------------------------------------------------------------------- known answers


def test_known_answer_mean_fusion(two_layer):
    # layer 1 mean: column 1 gets 0.5 + 0.1 = 0.6, the others 0.1 (rows sum to 1)
    # A1 = 0.5 W1 + 0.5 I:  row 0 = [0.55, 0.30, 0.05, 0.05, 0.05], row 3 = [0.05, 0.30, 0.05, 0.55, 0.05]
    # A2 row 0 = [0.5, 0, 0, 0.5, 0]  ->  R row 0 = 0.5 (A1 row 0 + A1 row 3) = [0.3, 0.3, 0.05, 0.3, 0.05]
    out = attention_rollout(two_layer, head_fusion="mean", num_prefix_tokens=1, grid_size=(2, 2))
    expected = torch.tensor([[[0.30, 0.05], [0.30, 0.05]]], dtype=torch.float64)
    assert out.shape == (1, 2, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_known_answer_max_and_min_fusion(two_layer):
    # max: layer 1 column 1 = 1, others 0.2 (row sum 1.8). A1 row 0 = [0.6, 0.5, 0.1, 0.1, 0.1] / 1.4,
    # row 3 = [0.1, 0.5, 0.1, 0.6, 0.1] / 1.4; R row 0 = [0.7, 1.0, 0.2, 0.7, 0.2] / 2.8
    out_max = attention_rollout(two_layer, head_fusion="max", grid_size=(2, 2))
    torch.testing.assert_close(
        out_max.flatten(), torch.tensor([5 / 14, 1 / 14, 1 / 4, 1 / 14], dtype=torch.float64), rtol=0, atol=1e-12
    )
    # min: layer 1 column 1 = 0.2, others 0 (row sum 0.2). A1 row 0 = [0.5, 0.1, 0, 0, 0] / 0.6,
    # row 3 = [0, 0.1, 0, 0.5, 0] / 0.6; R row 0 = [0.5, 0.2, 0, 0.5, 0] / 1.2
    out_min = attention_rollout(two_layer, head_fusion="min", grid_size=(2, 2))
    torch.testing.assert_close(
        out_min.flatten(), torch.tensor([1 / 6, 0.0, 5 / 12, 0.0], dtype=torch.float64), rtol=0, atol=1e-12
    )
    # max keeps head a's focus on patch 0 strongest; min keeps nothing of the uniform head
    out_mean = attention_rollout(two_layer, head_fusion="mean", grid_size=(2, 2))
    assert out_max.flatten()[0] > out_mean.flatten()[0] > out_min.flatten()[0]


def test_mean_pooled_model_known_answer():
    # no class token, 4 patches, every query attends to patch 2: A row i = 0.5 e_2 + 0.5 e_i.
    # mean over the 4 rows: column 2 = (4 * 0.5 + 0.5) / 4 = 0.625, others 0.5 / 4 = 0.125
    attn = one_hot_rows([2, 2, 2, 2], 4)[None, None]  # (1, 1, 4, 4)
    out = attention_rollout([attn], num_prefix_tokens=0, grid_size=(2, 2))
    expected = torch.tensor([[[0.125, 0.125], [0.625, 0.125]]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # the class query does not exist without a class token
    with pytest.raises(ValueError, match="num_prefix_tokens=0"):
        attention_rollout([attn], num_prefix_tokens=0, grid_size=(2, 2), query="cls")


def test_register_tokens_are_skipped_and_class_row_is_read():
    # class token + 2 registers + 4 patches. The class token puts 0.6 on register 1, 0.4 on patch 3;
    # one layer: A row 0 = 0.5 W row 0 + 0.5 e_0 (sums to 1), patch columns = [0, 0, 0, 0.2]
    n = 7
    w = torch.eye(n, dtype=torch.float64)
    w[0] = torch.tensor([0.0, 0.6, 0.0, 0.0, 0.0, 0.0, 0.4], dtype=torch.float64)
    out = attention_rollout([w[None, None]], num_prefix_tokens=3, grid_size=(2, 2))
    torch.testing.assert_close(out.flatten(), torch.tensor([0.0, 0.0, 0.0, 0.2], dtype=torch.float64))
    # random case against the reference, both query kinds
    attns = random_attn(2, 3, n, seed=4)
    for query in ("cls", "mean"):
        out = attention_rollout(attns, num_prefix_tokens=3, grid_size=(2, 2), query=query)
        for b in range(2):
            ref = reference_rollout(attns, b, prefix=3, query=query)
            torch.testing.assert_close(out[b].flatten().double(), ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_matches_loop_reference(fusion):
    attns = random_attn(2, 3, 1 + 6, seed=1)
    out = attention_rollout(attns, head_fusion=fusion, grid_size=(2, 3))
    for b in range(2):
        ref = reference_rollout(attns, b, fusion=fusion)
        torch.testing.assert_close(out[b].flatten().double(), ref, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- discard ratio


def test_discard_drops_lowest_patch_weights_per_row_and_keeps_class_column():
    # one layer, class row W = [0.02 (class), 0.4, 0.3, 0.2, 0.08]; ratio 0.5 of 4 patches -> drop 2.
    # The two lowest *patch* weights go (0.08, 0.2); the class weight 0.02 is lower still but kept.
    # A row 0 = 0.5 [0.02, 0.4, 0.3, 0, 0] + 0.5 e_0 = [0.51, 0.2, 0.15, 0, 0], sum 0.86
    n = 5
    w = torch.eye(n, dtype=torch.float64)
    w[0] = torch.tensor([0.02, 0.4, 0.3, 0.2, 0.08], dtype=torch.float64)
    attn = [w[None, None]]
    out = attention_rollout(attn, discard_ratio=0.5, grid_size=(2, 2))
    expected = torch.tensor([0.2 / 0.86, 0.15 / 0.86, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(out.flatten(), expected, rtol=0, atol=1e-12)
    # without discarding: [0.2, 0.15, 0.1, 0.04] (row sums to 1, no renormalisation needed)
    plain = attention_rollout(attn, discard_ratio=0.0, grid_size=(2, 2))
    torch.testing.assert_close(plain.flatten(), torch.tensor([0.2, 0.15, 0.1, 0.04], dtype=torch.float64))
    # too small a ratio to drop a whole patch (0.1 * 4 < 1) changes nothing
    torch.testing.assert_close(attention_rollout(attn, discard_ratio=0.1, grid_size=(2, 2)), plain)
    # the caller's tensor is untouched
    assert w[0, 4] == 0.08


def test_discard_sharpens_random_maps():
    attns = random_attn(2, 2, 1 + 16, seed=2)
    plain = attention_rollout(attns)
    sharp = attention_rollout(attns, discard_ratio=0.9)
    assert not torch.allclose(plain, sharp)
    # dropping the weak links concentrates the map: a larger share sits in its top 2 patches
    share = lambda m: m.flatten(1).topk(2).values.sum(1) / m.flatten(1).sum(1)  # noqa: E731
    assert (share(sharp) > share(plain)).all()


# ----------------------------------------------------------------------------- batching, grids, errors


def test_batch_equals_one_by_one():
    attns = random_attn(4, 3, 1 + 6, seed=3)
    for kw in (dict(), dict(head_fusion="max", discard_ratio=0.5), dict(num_prefix_tokens=0, grid_size=(1, 7))):
        kw.setdefault("grid_size", (2, 3))
        batched = attention_rollout(attns, **kw)
        for b in range(4):
            single = attention_rollout([a[b : b + 1] for a in attns], **kw)
            torch.testing.assert_close(batched[b : b + 1], single, rtol=0, atol=0)


def test_non_square_grid_is_row_major():
    # 1 class token + 6 patches on a 2x3 grid; the class token looks only at patch 4 = (row 1, col 1)
    n = 7
    w = torch.eye(n)
    w[0] = 0.0
    w[0, 1 + 4] = 1.0
    out = attention_rollout([w[None, None]], grid_size=(2, 3))
    assert out.shape == (1, 2, 3)
    assert divmod(out.flatten().argmax().item(), 3) == (1, 1)
    assert attention_rollout([w[None, None]], grid_size=(3, 2)).shape == (1, 3, 2)


def test_square_grid_inferred_else_error_names_count():
    assert attention_rollout(random_attn(1, 2, 1 + 9, seed=0)).shape == (1, 3, 3)
    with pytest.raises(ValueError, match="6 patch"):
        attention_rollout(random_attn(1, 2, 1 + 6, seed=0))
    with pytest.raises(ValueError, match=r"\(2, 2\).*6"):
        attention_rollout(random_attn(1, 2, 1 + 6, seed=0), grid_size=(2, 2))


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(head_fusion="median"), ["median", "mean", "max", "min"]),
        (dict(discard_ratio=1.0), ["1.0", "[0, 1)"]),
        (dict(discard_ratio=-0.1), ["-0.1", "[0, 1)"]),
        (dict(query="first"), ["first", "cls", "mean"]),
        (dict(num_prefix_tokens=10), ["num_prefix_tokens=10"]),
    ],
)
def test_bad_arguments_raise_with_value_and_choices(kw, words):
    with pytest.raises(ValueError) as err:
        attention_rollout(random_attn(1, 2, 5, seed=0), **kw)
    for word in words:
        assert word in str(err.value)


def test_bad_attention_inputs_raise():
    with pytest.raises(ValueError, match="non-empty"):
        attention_rollout([])
    with pytest.raises(ValueError, match=r"\(B, heads, N, N\)"):
        attention_rollout([torch.rand(2, 5, 5)])
    with pytest.raises(ValueError, match="layer 0"):
        attention_rollout([torch.rand(1, 2, 5, 5), torch.rand(1, 2, 10, 10)])


# ----------------------------------------------------------------------------- raw and cross maps


def test_attention_maps_per_layer_and_head():
    attns = random_attn(2, 3, 1 + 6, seed=5, layers=4)
    maps = attention_maps(attns, grid_size=(2, 3))
    assert maps.shape == (2, 4, 3, 2, 3)
    torch.testing.assert_close(maps[1, 2, 0].flatten(), attns[2][1, 0, 0, 1:])
    last = attention_maps(attns, layer=-1, grid_size=(2, 3))
    assert last.shape == (2, 1, 3, 2, 3)
    torch.testing.assert_close(last[:, 0], maps[:, 3])
    pooled = attention_maps(attns, num_prefix_tokens=0, layer=0, grid_size=(1, 7))
    torch.testing.assert_close(pooled[0, 0, 1].flatten(), attns[0][0, 1].mean(0))
    with pytest.raises(ValueError, match="layer=4"):
        attention_maps(attns, layer=4, grid_size=(2, 3))


def test_cross_attention_maps():
    g = torch.Generator().manual_seed(6)
    cross = torch.rand(2, 3, 4, 5, 1 + 6, generator=g).softmax(-1)  # (B, layers, heads, T, M)
    maps = cross_attention_maps(cross, (2, 3), num_prefix_tokens=1)
    assert maps.shape == (2, 5, 2, 3)
    torch.testing.assert_close(maps[1, 4].flatten(), cross[1, :, :, 4, 1:].mean((0, 1)))
    last = cross_attention_maps(cross, (2, 3), num_prefix_tokens=1, layer_fusion="last", head_fusion="max")
    torch.testing.assert_close(last[0, 2].flatten(), cross[0, -1, :, 2, 1:].amax(0))
    as_list = cross_attention_maps(list(cross.unbind(1)), (2, 3), num_prefix_tokens=1)
    torch.testing.assert_close(as_list, maps)
    with pytest.raises(ValueError, match="sum"):
        cross_attention_maps(cross, (2, 3), layer_fusion="sum")
    with pytest.raises(ValueError, match="7 patch"):
        cross_attention_maps(cross, None)


# ----------------------------------------------------------------------------- on a real ViT


@pytest.fixture(scope="module")
def micro():
    from vitpipe import create_model

    torch.manual_seed(0)
    return create_model("vit_micro", img_size=(16, 24), num_classes=5).eval()


def test_model_attentions_are_row_stochastic(micro):
    x = torch.randn(2, 3, 16, 24)
    tokens, attns = micro.forward_features(x, return_attn=True)
    assert len(attns) == len(micro.blocks)
    n = 1 + micro.grid_size[0] * micro.grid_size[1]
    for a in attns:
        assert a.shape == (2, 4, n, n)  # vit_micro: 4 heads
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]), rtol=0, atol=1e-5)


def test_rollout_for_model_shape_and_batch(micro):
    x = torch.randn(3, 3, 16, 24)
    out = rollout_for_model(micro, x)
    assert out.shape == (3, 4, 6)  # grid (16 / 4, 24 / 4), non-square
    assert torch.isfinite(out).all() and (out > 0).all()
    torch.testing.assert_close(out[1:2], rollout_for_model(micro, x[1:2]), rtol=1e-5, atol=1e-7)
    # a bigger input than the model was built for gives its own grid (positions are resampled)
    assert rollout_for_model(micro, torch.randn(1, 3, 32, 24)).shape == (1, 8, 6)


def test_rollout_for_mean_pooled_model_with_registers():
    from vitpipe import create_model

    model = create_model("vit_micro", img_size=16, num_classes=3, class_token=False, pool="mean", reg_tokens=2)
    x = torch.randn(2, 3, 16, 16)
    out = rollout_for_model(model, x)
    _, attns = model.forward_features(x, return_attn=True)
    torch.testing.assert_close(out, attention_rollout(attns, num_prefix_tokens=2, query="mean"))


def test_gradient_rollout_properties(micro):
    torch.manual_seed(1)
    x = torch.randn(3, 3, 16, 24)
    micro.train()  # must be switched to eval for the call and restored afterwards
    flags = [p.requires_grad for p in micro.parameters()]
    maps = gradient_rollout(micro, x)
    assert micro.training
    assert [p.requires_grad for p in micro.parameters()] == flags
    assert all(p.grad is None for p in micro.parameters())
    assert maps.shape == (3, 4, 6)
    assert (maps >= 0).all() and torch.isfinite(maps).all()
    # batched == one by one
    for b in range(3):
        torch.testing.assert_close(maps[b : b + 1], gradient_rollout(micro, x[b : b + 1]), rtol=1e-5, atol=1e-7)
    # default target is the predicted class
    micro.eval()
    pred = micro(x).argmax(-1)
    torch.testing.assert_close(maps, gradient_rollout(micro, x, pred))
    # different classes give different maps
    other = gradient_rollout(micro, x, (pred + 1) % 5)
    assert not torch.allclose(maps, other)
    with pytest.raises(ValueError, match="0..4"):
        gradient_rollout(micro, x, 5)


def test_gradient_heads_keep_positive_part_per_head():
    # one entry, two heads: grad * attn = 0.5 * 0.8 = +0.4 and -1.0 * 0.2 = -0.2.
    # positive part per head, then mean: (0.4 + 0) / 2 = 0.2 (mean first would give 0.1)
    attn = torch.tensor([0.8, 0.2]).reshape(1, 2, 1, 1)
    grad = torch.tensor([0.5, -1.0]).reshape(1, 2, 1, 1)
    torch.testing.assert_close(gradient_weighted(attn, grad), torch.tensor([[[0.2]]]))


def test_gradient_rollout_matches_manual_recursion(micro):
    # d logit / d attention by hand, then the loop reference on the fused weights
    x = torch.randn(2, 3, 16, 24)
    tokens, attns = micro.forward_features(x, return_attn=True)
    logits = micro.forward_head(tokens)
    grads = torch.autograd.grad(logits[:, 3].sum(), attns)
    fused = [(g * a).clamp(min=0).mean(1, keepdim=True).detach() for g, a in zip(grads, attns)]  # (B, 1, N, N)
    fused = [w / w.sum(-1, keepdim=True) for w in fused]  # rows of grad * attn rescaled to sum 1
    maps = gradient_rollout(micro, x, 3)
    for b in range(2):
        ref = reference_rollout(fused, b)
        torch.testing.assert_close(maps[b].flatten().double(), ref, rtol=1e-4, atol=1e-7)


def test_gradient_rollout_ignores_logit_scale():
    # a temperature on the logits scales every gradient alike; the map must not move
    from vitpipe import create_model

    torch.manual_seed(2)
    model = create_model("vit_micro", img_size=16, num_classes=3).eval()
    x = torch.randn(2, 3, 16, 16)
    before = gradient_rollout(model, x, 1)
    with torch.no_grad():
        model.head.weight.mul_(10.0)
        model.head.bias.mul_(10.0)
    torch.testing.assert_close(gradient_rollout(model, x, 1), before, rtol=1e-4, atol=1e-6)


def test_gradient_rollout_on_frozen_model(micro):
    for p in micro.parameters():
        p.requires_grad_(False)
    try:
        maps = gradient_rollout(micro, torch.randn(2, 3, 16, 24))
        assert maps.shape == (2, 4, 6) and maps.sum() > 0
        assert not any(p.requires_grad for p in micro.parameters())
    finally:
        for p in micro.parameters():
            p.requires_grad_(True)

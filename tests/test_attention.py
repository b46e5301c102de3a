"""The attention core: fused vs explicit paths, causality, KV cache, masks, errors."""

import pytest
import torch

from vitpipe.nn.attention import KVCache, MultiHeadAttention, causal_mask


def _mha(dim=32, heads=4, **kw):
    torch.manual_seed(0)
    return MultiHeadAttention(dim, heads, **kw).eval()


def _both_paths(m, x, **kw):
    fused = m(x, **kw)
    explicit, w = m(x, need_weights=True, **kw)
    return fused, explicit, w


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_equals_explicit_self(qk_norm):
    m, x = _mha(qk_norm=qk_norm), torch.randn(3, 7, 32)
    fused, explicit, w = _both_paths(m, x)
    assert (fused - explicit).abs().max() < 1e-5
    assert w.shape == (3, 4, 7, 7)
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 7))


@pytest.mark.parametrize("context_dim", [32, 48])  # a context as wide as the queries, and a wider one
def test_fused_equals_explicit_cross(context_dim):
    m = _mha(context_dim=context_dim)
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 9, context_dim)
    fused, explicit, w = _both_paths(m, x, context=ctx)
    assert (fused - explicit).abs().max() < 1e-5
    assert w.shape == (2, 4, 5, 9)


def test_fused_equals_explicit_causal_and_masked():
    m, x = _mha(), torch.randn(2, 6, 32)
    fused, explicit, w = _both_paths(m, x, is_causal=True)
    assert (fused - explicit).abs().max() < 1e-5
    assert (w.triu(1) == 0).all()  # nothing above the diagonal
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # second sequence padded
    mask = torch.rand(2, 1, 6, 6) > 0.3
    mask[..., 0] = True  # every row keeps one key
    fused, explicit, w = _both_paths(m, x, attn_mask=mask, key_padding_mask=pad)
    assert (fused - explicit).abs().max() < 1e-5
    assert (w[1, :, :, 4:] == 0).all()
    assert (w.masked_select(~mask.expand_as(w)) == 0).all()


def test_causality_future_tokens_do_not_change_the_past():
    m, x = _mha(), torch.randn(2, 8, 32)
    base = m(x, is_causal=True)
    for i in range(7):
        x2 = x.clone()
        x2[:, i + 1 :] = torch.randn_like(x2[:, i + 1 :])
        out = m(x2, is_causal=True)
        assert (out[:, : i + 1] - base[:, : i + 1]).abs().max() < 1e-6
        assert (out[:, i + 1 :] - base[:, i + 1 :]).abs().max() > 1e-3  # the future did change


def test_kv_cache_incremental_equals_full_recompute():
    m, x = _mha(), torch.randn(2, 9, 32)
    full = m(x, is_causal=True)
    cache, steps = KVCache(), []
    steps.append(m(x[:, :3], is_causal=True, cache=cache))  # a 3-token prompt, then one token at a time
    for t in range(3, 9):
        steps.append(m(x[:, t : t + 1], is_causal=True, cache=cache))
    assert cache.length == 9
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_cross_attention_cache_projects_context_once():
    m = _mha(context_dim=16)
    x, ctx = torch.randn(2, 4, 32), torch.randn(2, 5, 16)
    cache = KVCache()
    first = m(x, ctx, cache=cache)
    k = cache.k
    again = m(x, torch.zeros_like(ctx), cache=cache)  # context ignored: K/V come from the cache
    assert cache.k is k and torch.equal(first, again)


def test_causal_mask_with_cache_is_bottom_aligned():
    mask = causal_mask(2, 5)
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_heads_are_batched_not_looped():
    # a 1-head module on each head's slice gives the same output as the multi-head module: heads are independent
    m = _mha(dim=8, heads=2)
    x = torch.randn(1, 3, 8)
    _, w = m(x, need_weights=True)
    q, k, _ = m.qkv(x).view(1, 3, 3, 2, 4).permute(2, 0, 3, 1, 4)
    for h in range(2):
        ref = ((q[:, h] @ k[:, h].transpose(-1, -2)) * 4**-0.5).softmax(-1)
        torch.testing.assert_close(w[:, h], ref)


def test_dim_not_divisible_by_heads_names_both_numbers():
    with pytest.raises(ValueError, match=r"dim=30.*num_heads=4"):
        MultiHeadAttention(30, 4)


def test_mode_is_fixed_at_construction():
    self_attn, cross = _mha(), _mha(context_dim=16)
    assert {n for n, _ in self_attn.named_children()} >= {"qkv"} and not hasattr(self_attn, "kv")
    assert {"q", "kv"} <= {n for n, _ in cross.named_children()} and not hasattr(cross, "qkv")
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="self-attention"):
        self_attn(x, torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="cross-attention"):
        cross(x)


def test_kv_cache_with_rope_equals_full_recompute():
    # each call rotates its own keys before they are cached, with the phases of their positions
    from vitpipe.nn.rope import rope_2d

    m, x = _mha(), torch.randn(2, 6, 32)
    cos, sin = rope_2d(2, 3, 8)  # (6, head_dim)
    full = m(x, is_causal=True, rope=(cos, sin))
    cache = KVCache()
    steps = [m(x[:, t : t + 1], is_causal=True, cache=cache, rope=(cos[t : t + 1], sin[t : t + 1])) for t in range(6)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_a_float_bias_with_a_boolean_mask_is_one_thing_in_both_paths():
    """attn_bias is added to the logits, in SDPA (folded with the mask into one float mask) and in the
    explicit path alike; need_logits returns those logits, -inf where masked, softmax = the weights."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).eval()
    x, bias = torch.randn(2, 7, 32), torch.randn(1, 4, 7, 7)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    mask[..., 0] = True  # every query keeps a key
    fused = attn(x, attn_bias=bias, attn_mask=mask)
    out, weights = attn(x, attn_bias=bias, attn_mask=mask, need_weights=True)
    _, logits = attn(x, attn_bias=bias, attn_mask=mask, need_logits=True)
    torch.testing.assert_close(fused, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.softmax(-1), weights)
    assert torch.isneginf(logits[~mask.expand(2, 4, 7, 7)]).all()
    q, k, _ = attn.qkv(x).view(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)
    expected = (q @ k.transpose(-2, -1)) * 8**-0.5 + bias  # the scale on q.k, then the bias
    torch.testing.assert_close(logits[mask.expand(2, 4, 7, 7)], expected[mask.expand(2, 4, 7, 7)], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused, attn(x, attn_mask=mask), atol=1e-3)  # the bias does something


def test_a_bias_on_causal_attention_keeps_it_causal_with_and_without_a_cache():
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2).eval()
    x, bias = torch.randn(1, 6, 16), torch.randn(1, 2, 6, 6)
    full = attn(x, is_causal=True, attn_bias=bias)
    cache, steps = KVCache(), []
    for t in range(6):
        steps.append(attn(x[:, t : t + 1], is_causal=True, cache=cache, attn_bias=bias[:, :, t : t + 1, : t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)

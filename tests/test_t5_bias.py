"""T5's bucketed relative position bias (vitpipe/nn/rel_pos_text.py) and the captioner's text_rel_pos=t5:
bucket and bias parity with Hugging Face's T5Attention, cached decoding against the full pass, config."""

from __future__ import annotations

import pytest
import torch

from vitpipe.errors import ConfigError
from vitpipe.models import create_model
from vitpipe.models.captioner import Captioner
from vitpipe.nn.rel_pos_text import T5RelativeBias, relative_position_bucket

t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
from transformers import T5Config  # noqa: E402

V = 12
# (num_buckets, max_distance): T5's own, small ones whose log bins are one or two offsets wide, odd counts
SETTINGS = [(32, 128), (8, 20), (16, 64), (5, 7), (64, 512)]


def hf_bias(num_buckets: int, max_distance: int, num_heads: int, *, is_decoder: bool = True):
    cfg = T5Config(d_model=4 * num_heads, d_kv=4, num_heads=num_heads, relative_attention_num_buckets=num_buckets,
                   relative_attention_max_distance=max_distance, is_decoder=is_decoder)  # fmt: skip
    return t5.T5Attention(cfg, has_relative_attention_bias=True).eval()


@pytest.mark.parametrize("num_buckets, max_distance", SETTINGS)
@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
def test_buckets_equal_hf_t5(num_buckets, max_distance, bidirectional):
    offsets = torch.arange(-3 * max_distance, 3 * max_distance + 1)[None, :] + torch.arange(0, 3)[:, None]  # (3, K)
    ours = relative_position_bucket(offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    ref = t5.T5Attention._relative_position_bucket(offsets, bidirectional=bidirectional, num_buckets=num_buckets,
                                                   max_distance=max_distance)  # fmt: skip
    assert torch.equal(ours, ref.long())
    top = num_buckets // 2 * 2 - 1 if bidirectional else num_buckets - 1  # an odd count loses one bucket when halved
    assert ours.min() == 0 and ours.max() == top  # every bucket reachable on this grid


def test_bucket_golden_values():
    """Causal, 32 buckets, 128: 16 exact buckets, then log bins; at and past 128 the last bucket."""
    d = torch.tensor([1, 0, -1, -15, -16, -20, -32, -64, -127, -128, -1000])
    got = relative_position_bucket(d, bidirectional=False, num_buckets=32, max_distance=128)
    assert got.tolist() == [0, 0, 1, 15, 16, 17, 21, 26, 31, 31, 31]


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20)])
@pytest.mark.parametrize("is_decoder", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("q_len, k_len, past", [(9, 9, 0), (1, 40, 39), (3, 200, 197)])
def test_bias_equals_hf_compute_bias(num_buckets, max_distance, is_decoder, q_len, k_len, past):
    torch.manual_seed(0)
    ours = T5RelativeBias(3, num_buckets=num_buckets, max_distance=max_distance, bidirectional=not is_decoder)
    with torch.no_grad():
        ours.relative_attention_bias.weight.normal_()  # random, far from zero
    ref = hf_bias(num_buckets, max_distance, 3, is_decoder=is_decoder)
    ref.relative_attention_bias.load_state_dict(ours.relative_attention_bias.state_dict())
    # HF's rows for the whole sequence, then the new queries' rows: its compute_bias keyword for a cache
    # moved between releases (cache_position in 4.x, past_seen_tokens in 5.x); the rows did not
    a, b = ours(q_len, k_len, past=past), ref.compute_bias(k_len, k_len)[:, :, past : past + q_len]
    assert a.shape == b.shape == (1, 3, q_len, k_len)
    assert (a - b).abs().max().item() == 0.0
    assert a.abs().max() > 0.5


# ---------------------------------------------------------------- the captioner


def tiny(decoder: str = "cross", seed: int = 0, **kw) -> Captioner:
    torch.manual_seed(seed)
    encoder = create_model("vit_micro", num_classes=0, img_size=16, depth=1, dim=32, num_heads=2)
    kw = {"text_rel_pos": "t5", "text_rel_pos_buckets": 8, "text_rel_pos_max_distance": 6, **kw}
    model = Captioner(encoder=encoder, vocab_size=V, dim=48, depth=2, num_heads=4, max_len=10, decoder=decoder, **kw)
    if model.rel_pos is not None:  # a bias that moves the logits, not the .02 init
        with torch.no_grad():
            model.rel_pos.relative_attention_bias.weight.normal_(0, 2.0)
    return model.eval()


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_one_bias_table_for_all_layers_and_no_absolute_positions():
    model = tiny()
    tables = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert tables == ["rel_pos.relative_attention_bias.weight"]  # one module shared by the decoder's layers
    assert model.pos_embed is None and model.text_pos == "none"  # T5: no absolute positions by default
    assert "rel_pos.relative_attention_bias.weight" in model.no_weight_decay()
    assert tiny(text_pos="learned").pos_embed.shape == (1, 10, 48)  # asked for: both


@pytest.mark.parametrize("decoder", ["cross", "prefix"])
def test_every_layer_receives_the_bias(decoder):
    model, x = tiny(decoder), images()
    seen = []
    for blk in model.blocks:
        blk.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attn_bias"]), with_kwargs=True)
    model(x, torch.randint(3, V, (2, 7)))
    assert len(seen) == 2 and seen[0] is seen[1]
    M = model.encode(x).shape[1]
    bias = seen[0][0]  # (heads, N, K)
    text = bias[:, M:, M:] if decoder == "prefix" else bias
    torch.testing.assert_close(text, model.rel_pos(7, 7)[0], rtol=0, atol=0)
    if decoder == "prefix":  # the image tokens have no text position: no bias to or from them
        assert bias.shape == (4, M + 7, M + 7) and bias[:, :M].abs().max() == 0 and bias[:, :, :M].abs().max() == 0


@pytest.mark.parametrize("decoder", ["cross", "prefix"])
def test_bias_orders_the_words_and_stays_causal(decoder):
    model, x = tiny(decoder), images()
    tokens = torch.randint(3, V, (2, 8))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1 - 3) % (V - 3) + 3
    a, b = model(x, tokens), model(x, changed)
    assert (a[:, :5] - b[:, :5]).abs().max() == 0  # later words never reach earlier logits
    with torch.no_grad():
        model.rel_pos.relative_attention_bias.weight.zero_()
    assert (model(x, tokens) - a).abs().max() > 1e-3  # the bias is what the logits read


@pytest.mark.parametrize("decoder", ["cross", "prefix"])
@pytest.mark.parametrize("split", [1, 3])
def test_cached_decoding_matches_the_full_pass(decoder, split):
    """KV cache: the bias rows of the new queries [past, past + T) against keys [0, past + T)."""
    model, x = tiny(decoder), images()
    tokens = torch.randint(3, V, (2, 10))
    tokens[:, 0] = model.bos_id
    full = model(x, tokens)
    memory = model.encode(x)
    state = model.init_state(memory)
    steps = [model.decode(tokens[:, t : t + split], memory, state=state)[0] for t in range(0, 10, split)]
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("decoder", ["cross", "prefix"])
def test_greedy_generate_matches_recompute(decoder):
    model, x = tiny(decoder, seed=3), images(3)
    with torch.no_grad():  # varied words, not the .02 init's echo of the input word
        for name, p in model.named_parameters():
            if not name.startswith(("encoder", "rel_pos")) and p.dim() > 1:
                p.normal_(0, 0.3)
    got = model.generate(x, max_len=9)
    seq = torch.full((3, 1), model.bos_id)
    for _ in range(got.shape[1]):
        seq = torch.cat([seq, model(x, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    done = torch.cumsum((seq[:, 1:] == model.eos_id).long(), dim=1) - (seq[:, 1:] == model.eos_id).long() > 0
    torch.testing.assert_close(got, seq[:, 1:].masked_fill(done, model.pad_id), rtol=0, atol=0)


def test_default_off_leaves_the_captioner_as_it_was():
    torch.manual_seed(0)
    encoder = create_model("vit_micro", num_classes=0, img_size=16, depth=1, dim=32, num_heads=2)
    model = Captioner(encoder=encoder, vocab_size=V, dim=48, depth=2, num_heads=4, max_len=10)
    assert model.rel_pos is None and model.text_pos == "learned"
    assert not any("rel_pos" in k for k in model.state_dict())
    old = Captioner(encoder=encoder, vocab_size=V, dim=48, depth=2, num_heads=4, max_len=10, text_pos="learned")
    assert model.state_dict().keys() == old.state_dict().keys()
    model.load_state_dict(old.state_dict())  # a checkpoint from before the option loads strictly


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"text_rel_pos": "alibi"}, r"text_rel_pos='alibi'; valid choices: none, t5"),
        ({"text_rel_pos_buckets": 1}, r"text_rel_pos_buckets=1: expected an int >= 2"),
        ({"text_rel_pos_buckets": 32, "text_rel_pos_max_distance": 16}, r"text_rel_pos_max_distance=16 must exceed"),
        ({"text_pos": "rope"}, r"text_pos='rope'; valid choices: learned, sincos, none"),
    ],
)
def test_bad_values_raise_one_line_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match) as err:
        tiny(**kw)
    assert "\n" not in str(err.value)


def test_reachable_from_hydra(cfg_factory):
    from vitpipe.run.build import build_from_config

    cfg = cfg_factory("experiment=caption_shapes", "debug=fast", "model.text_rel_pos=t5", "model.text_rel_pos_buckets=16",
                      "model.text_rel_pos_max_distance=64", "data.num_train=8", "data.num_val=4", "data.num_test=4")  # fmt: skip
    _, net, _ = build_from_config(cfg)
    assert net.rel_pos.num_buckets == 16 and net.rel_pos.max_distance == 64 and net.pos_embed is None
    _, net, _ = build_from_config(cfg_factory("experiment=caption_shapes", "debug=fast", "data.num_train=8", sub="off"))
    assert net.rel_pos is None and net.text_pos == "learned"

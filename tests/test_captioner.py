"""Captioner: causality, KV cache parity, greedy/beam search, prefix-LM structure, overfitting."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from vitpipe.config.build import build_trainer
from vitpipe.errors import ConfigError
from vitpipe.models import ViT, create_model
from vitpipe.models.captioner import Captioner, prefix_lm_mask
from vitpipe.nn.attention import MultiHeadAttention

DECODERS = ("cross", "prefix")
V = 12


def tiny(decoder: str, *, text_pos: str = "learned", vocab_size: int = V, seed: int = 0, **kw) -> Captioner:
    torch.manual_seed(seed)
    encoder = create_model("vit_micro", num_classes=0, img_size=16, depth=1, dim=32, num_heads=2)
    # decoder width differs from the encoder's, so cross-attention runs with context_dim != dim
    return Captioner(encoder=encoder, vocab_size=vocab_size, dim=48, depth=2, num_heads=4, max_len=10,
                     decoder=decoder, text_pos=text_pos, **kw).eval()


def images(n: int = 2, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("text_pos", ["learned", "sincos"])
def test_logits_at_i_ignore_later_tokens(decoder, text_pos):
    model, x = tiny(decoder, text_pos=text_pos), images()
    tokens = torch.randint(3, V, (2, 8))
    changed = tokens.clone()
    changed[:, 5:] = (changed[:, 5:] + 1 - 3) % (V - 3) + 3  # different words after position 4
    a, b = model(x, tokens), model(x, changed)
    assert a.shape == (2, 8, V)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-4  # later positions do see their own inputs


@pytest.mark.parametrize("decoder", DECODERS)
def test_padding_mask_leaves_real_positions_unchanged(decoder):
    model, x = tiny(decoder), images()
    tokens = torch.tensor([[1, 5, 6, 2, 0, 0], [1, 7, 8, 9, 4, 2]])
    pad = tokens == 0
    a, b = model(x, tokens, key_padding_mask=pad), model(x, tokens)
    torch.testing.assert_close(a[~pad], b[~pad])  # causal + right padding: pads only follow real words


@pytest.mark.parametrize("decoder", DECODERS)
def test_cached_steps_match_full_recompute(decoder):
    model, x = tiny(decoder), images()
    tokens = torch.randint(3, V, (2, 7))
    tokens[:, 0] = model.bos_id
    full = model(x, tokens)
    memory = model.encode(x)
    state = model.init_state(memory)
    steps = [model.decode(tokens[:, t : t + 1], memory, state=state)[0] for t in range(tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    # a cached call over several tokens at once continues the same sequence
    state = model.init_state(memory)
    first = model.decode(tokens[:, :3], memory, state=state)[0]
    rest = model.decode(tokens[:, 3:], memory, state=state)[0]
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def greedy_by_recompute(model: Captioner, x: torch.Tensor, max_len: int):
    """Reference greedy decoding: the whole prefix re-run through forward() at every step, no cache."""
    seq = torch.full((x.shape[0], 1), model.bos_id)
    done = torch.zeros(x.shape[0], dtype=torch.bool)
    for _ in range(max_len):
        nxt = model(x, seq)[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, model.pad_id), nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        done |= nxt == model.eos_id
        if done.all():
            break
    return seq[:, 1:]


def scrambled(decoder: str, seed: int, vocab_size: int = V) -> Captioner:
    """Decoder matrices drawn with a large std. At the .02 init with tied embeddings the argmax
    just repeats the input word; these emit varied words and sometimes <eos>, so search and
    stopping are exercised."""
    model = tiny(decoder, seed=seed, vocab_size=vocab_size)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("encoder") and p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.mark.parametrize("decoder", DECODERS)
def test_greedy_generate_matches_uncached_greedy(decoder):
    x, stopped, ran_out = images(3), 0, 0
    for seed in range(4):
        model = scrambled(decoder, seed)
        expected = greedy_by_recompute(model, x, 9)
        got = model.generate(x, max_len=9, beam_size=1)
        torch.testing.assert_close(got, expected)
        stopped += int((got == model.eos_id).any(dim=1).sum())
        ran_out += int((got != model.pad_id).all(dim=1).sum())
    assert stopped > 0 and ran_out > 0  # both ways a caption ends were exercised


def score_all(model: Captioner, x: torch.Tensor, captions: list[list[int]]) -> list[float]:
    """Summed log-probability of each caption for one image x (1, C, H, W), in one batched forward
    (right padding is harmless: position i only sees tokens up to i)."""
    T = max(map(len, captions))
    seq = torch.full((len(captions), T + 1), model.pad_id)
    seq[:, 0] = model.bos_id
    for row, c in zip(seq, captions):
        row[1 : len(c) + 1] = torch.tensor(c)
    logp = model(x.expand(len(captions), -1, -1, -1), seq[:, :-1]).log_softmax(-1)  # (N, T, V)
    tok = logp.gather(-1, seq[:, 1:, None])[..., 0]  # (N, T)
    real = torch.arange(T)[None] < torch.tensor([len(c) for c in captions])[:, None]
    return (tok * real).sum(1).tolist()


def strip(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("decoder", DECODERS)
def test_unpruned_beam_finds_the_exhaustive_best(decoder):
    """With beam_size >= V^L nothing is ever pruned, so the beam's pick must be the best of all
    captions up to L words, found by enumerating them and scoring each by full recompute."""
    vocab, L, x = 5, 4, images(1)
    lengths_seen = set()
    for seed in range(4):
        model = scrambled(decoder, seed, vocab_size=vocab)
        captions = [list(w) for n in range(1, L + 1) for w in itertools.product(range(vocab), repeat=n)
                    if model.eos_id not in w[:-1] and (n == L or w[-1] == model.eos_id)]  # <eos> ends a caption
        scores = dict(zip(map(tuple, captions), score_all(model, x, captions)))
        for alpha in (0.0, 1.0):
            best = max(scores, key=lambda c: scores[c] / len(c) ** alpha)
            got = model.generate(x, max_len=L, beam_size=vocab**L, length_penalty=alpha)[0].tolist()
            assert strip(got, model.eos_id) == list(best)
            lengths_seen.add(len(best))
        greedy = strip(model.generate(x, max_len=L, beam_size=1)[0].tolist(), model.eos_id)
        assert scores[tuple(greedy)] <= max(scores.values()) + 1e-6
    assert len(lengths_seen) > 1  # short and long winners both occurred


def beam_by_recompute(model: Captioner, x: torch.Tensor, *, beam_size: int, max_len: int, alpha: float):
    """Reference beam search for one image, every hypothesis re-scored through forward(): no cache
    to reorder. Same rules as ``generate``: rank by summed log-probability, finished beams keep
    their score, the final pick divides by length ** alpha."""
    beams = [(0.0, [model.bos_id], False)]
    for _ in range(max_len):
        cands = []
        for total, seq, done in beams:
            if done:
                cands.append((total, seq + [model.pad_id], True))
                continue
            logp = model(x, torch.tensor([seq]))[0, -1].log_softmax(-1)
            cands += [(total + logp[w].item(), seq + [w], w == model.eos_id) for w in range(model.vocab_size)]
        beams = sorted(cands, key=lambda c: -c[0])[:beam_size]
        if all(done for _, _, done in beams):
            break
    length = lambda seq: sum(w != model.pad_id for w in seq[1:])  # noqa: E731
    return max(beams, key=lambda c: c[0] / length(c[1]) ** alpha)[1][1:]


@pytest.mark.parametrize("decoder", DECODERS)
def test_beam_search_matches_uncached_reference(decoder):
    x = images(1)
    for seed, beam_size, alpha in ((0, 2, 0.0), (1, 3, 1.0), (2, 4, 1.0), (3, 3, 0.5)):
        model = scrambled(decoder, seed)
        got = model.generate(x, max_len=7, beam_size=beam_size, length_penalty=alpha)[0].tolist()
        expected = beam_by_recompute(model, x, beam_size=beam_size, max_len=7, alpha=alpha)
        assert strip(got, model.eos_id) == strip(expected, model.eos_id), (seed, beam_size, alpha)


@pytest.mark.parametrize("decoder", DECODERS)
def test_beam_search_batches_independently(decoder):
    model, x = scrambled(decoder, 1), images(3)
    together = model.generate(x, max_len=8, beam_size=3)
    for i in range(3):
        alone = model.generate(x[i : i + 1], max_len=8, beam_size=3)
        torch.testing.assert_close(alone[0, : alone.shape[1]], together[i, : alone.shape[1]])


@pytest.mark.parametrize("decoder", DECODERS)
def test_generate_returns_attention_over_image_tokens(decoder):
    model, x = scrambled(decoder, 2), images(2)
    ids, attn = model.generate(x, max_len=6, beam_size=2, return_cross_attn=True)
    M = model.num_prefix_tokens + model.grid_size[0] * model.grid_size[1]
    assert attn.shape == (2, 2, 4, ids.shape[1], M)
    live = torch.ones_like(ids, dtype=torch.bool)
    live[:, 1:] = ids[:, :-1] != model.eos_id
    live = live.cumprod(dim=1).bool()  # positions up to and including <eos>
    mass = attn.sum(-1)  # (B, depth, heads, T)
    assert (mass.permute(0, 3, 1, 2)[~live] == 0).all()
    if decoder == "cross":  # a softmax over the image tokens only
        torch.testing.assert_close(mass.permute(0, 3, 1, 2)[live], torch.ones_like(mass.permute(0, 3, 1, 2)[live]))
    else:  # the image prefix takes part of a softmax that also covers the words
        live_mass = mass.permute(0, 3, 1, 2)[live]
        assert (live_mass > 0).all() and (live_mass <= 1 + 1e-6).all()


def test_prefix_variant_has_no_cross_attention():
    model = tiny("prefix")
    decoder_parts = [m for n, m in model.named_modules() if not n.startswith("encoder")]
    assert not any(blk.has_cross_attention for blk in model.blocks)
    assert not any(isinstance(m, MultiHeadAttention) and not hasattr(m, "qkv") for m in decoder_parts)
    assert not any("cross" in n for n, _ in model.named_parameters())
    assert all(blk.has_cross_attention for blk in tiny("cross").blocks)


def test_prefix_lm_mask():
    m = prefix_lm_mask(5, 5, 3)  # 3 image tokens, 2 words
    expected = torch.tensor([[1, 1, 1, 0, 0]] * 3 + [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert prefix_lm_mask(1, 6, 3).all()  # a cached step sees everything before it
    assert torch.equal(prefix_lm_mask(4, 4, 0), torch.ones(4, 4, dtype=torch.bool).tril())


def test_prefix_image_tokens_attend_to_each_other_fully():
    """Under the prefix-LM mask the first image token's block output depends on the last image
    token; under a plain causal mask it would not."""
    model = tiny("prefix")
    memory = model.encode(images(1))  # (1, M, dim)
    M = memory.shape[1]
    changed = memory.clone()
    changed[:, -1] += torch.randn(model.dim, generator=torch.Generator().manual_seed(0))
    blk = model.blocks[0]
    for mask, should_change in ((prefix_lm_mask(M, M, M), True), (prefix_lm_mask(M, M, 0), False)):
        delta = (blk(changed, attn_mask=mask) - blk(memory, attn_mask=mask))[:, 0].abs().max()
        assert bool(delta > 1e-5) == should_change


def test_tied_embeddings_and_weight_decay_names():
    model = tiny("cross")
    assert model.head.weight is model.tok_embed.weight
    names = dict(model.named_parameters())
    assert model.no_weight_decay() <= set(names)
    assert "pos_embed" in model.no_weight_decay()
    assert "pos_embed" not in tiny("cross", text_pos="sincos").no_weight_decay()


def test_encoder_from_name_dict_and_classification_checkpoint(tmp_path):
    torch.manual_seed(0)
    clf = create_model("vit_micro", num_classes=10)
    ckpt = tmp_path / "clf.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in clf.state_dict().items()}}, ckpt)
    cap = Captioner(encoder={"name": "vit_micro"}, vocab_size=V, dim=32, depth=1, num_heads=2,
                    encoder_ckpt=str(ckpt))
    assert isinstance(cap.encoder, ViT) and cap.encoder.num_classes == 0
    for k, v in cap.encoder.state_dict().items():
        torch.testing.assert_close(v, clf.state_dict()[k])
    assert isinstance(Captioner(encoder="vit_micro", vocab_size=V, dim=32, depth=1, num_heads=2).encoder, ViT)
    with pytest.raises(ConfigError, match="missing.ckpt"):
        Captioner(encoder="vit_micro", vocab_size=V, encoder_ckpt=str(tmp_path / "missing.ckpt"))


def test_bad_options_raise_config_error():
    with pytest.raises(ConfigError, match="decoder='gpt'"):
        tiny("gpt")
    with pytest.raises(ConfigError, match="text_pos='rope'"):
        tiny("cross", text_pos="rope")
    with pytest.raises(ConfigError, match="beam_size=0"):
        tiny("cross").generate(images(), beam_size=0)
    with pytest.raises(ValueError, match="max_len=10"):
        tiny("cross")(images(), torch.ones(2, 11, dtype=torch.long))


@pytest.mark.parametrize("decoder", DECODERS)
def test_overfits_four_shapes_captions(decoder):
    """A few hundred steps on 4 images learn their exact captions (greedy decode == target)."""
    from vitpipe.data.captions.shapes import ShapesCaptionDataModule

    dm = ShapesCaptionDataModule(num_train=4, num_val=1, num_test=1, max_len=20, seed=3)
    data = dm._dataset("train")
    x = torch.stack([data.image(i) for i in range(4)])
    targets = [refs[0] for refs in data.refs]
    tokens = dm.tokenizer.batch_encode(targets)
    torch.manual_seed(0)
    model = Captioner(encoder=create_model("vit_micro", num_classes=0, depth=2), decoder=decoder, dim=64, depth=2,
                      num_heads=4, max_len=20, **dm.model_kwargs())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(150):  # ~5-10 s on one core
        logits = model(x, tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], ignore_index=dm.tokenizer.pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    decoded = dm.tokenizer.batch_decode(model.generate(x, max_len=19))
    assert decoded == targets, (loss.item(), decoded, targets)


# ---------------------------------------------------------------- training pipeline


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("decoder", DECODERS)
def test_caption_experiment_trains_scores_and_checkpoints_its_tokenizer(cfg_factory, tmp_path, decoder):
    """experiment=caption_shapes through train(): scores logged; the checkpoint carries its
    tokenizer and replaces a module's own on load; test predictions written with image ids."""
    import lightning as L

    from vitpipe.lit.captioner import CaptionModule
    from vitpipe.run.build import build_from_config
    from vitpipe.run.stored import load_checkpoint
    from vitpipe.tasks.train import train
    from vitpipe.text import WordTokenizer

    cfg = cfg_factory("experiment=caption_shapes", "debug=fast", f"model.decoder={decoder}", "data.num_train=64",
                      "data.num_val=16", "data.num_test=16", "module.beam_size=2")
    metrics = train(cfg)
    for split in ("val", "test"):
        assert {f"{split}/{k}" for k in ("bleu1", "bleu4", "cider", "loss")} <= set(metrics)
    assert 0 <= metrics["test/bleu4"] <= 1 and metrics["test/cider"] >= 0
    assert metrics["val/cider_best"] == pytest.approx(metrics["val/cider"])  # one epoch: best = last
    ckpt = next(Path(cfg.paths.output_dir).rglob("*.ckpt"))
    dm, net, _ = build_from_config(cfg)
    trained = WordTokenizer.from_state_dict(load_checkpoint(ckpt)["tokenizer"])
    assert trained.itos == dm.tokenizer.itos

    shuffled = WordTokenizer([*trained.itos[:4], *reversed(trained.itos[4:])])  # same size, other ids
    module = CaptionModule(net=net, tokenizer=shuffled, optimizer=None)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.test(module, datamodule=dm, ckpt_path=str(ckpt), weights_only=True)
    assert module.tokenizer.itos == trained.itos
    rows = json.loads(module.write_predictions(tmp_path / "captions.json").read_text())
    assert [r["image_id"] for r in rows] == list(range(16)) and set(rows[0]) == {"image_id", "caption"}
    assert all(set(r["caption"].split()) <= set(trained.itos) for r in rows)


def test_caption_nan_loss_stops_with_the_one_line_error_naming_the_step(cfg_factory):
    """The captioner shares the classifier's guard: NonFiniteLossError (vitpipe.tasks.cli prints it as one
    line, exit 3), not a bare FloatingPointError traceback."""

    from vitpipe.lit.classifier import NonFiniteLossError
    from vitpipe.run.build import build_from_config

    cfg = cfg_factory("experiment=caption_shapes", "debug=fast", "data.num_train=32", "data.num_val=4",
                      "data.num_test=4", "trainer.limit_train_batches=2")
    dm, net, module = build_from_config(cfg)
    net.register_forward_hook(lambda m, i, out: out * float("nan") if m.training else out)
    trainer = build_trainer(cfg.trainer, logger=False, enable_checkpointing=False)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at global step 0 .*module.nonfinite=skip"):
        trainer.fit(module, dm)

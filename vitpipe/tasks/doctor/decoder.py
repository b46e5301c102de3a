"""A captioner's decoder: checks 3 (causal) and 4 (cross_kv).

causal: the logits at position t against words changed after t (full pass), and cached incremental
decoding against the full pass. cross_kv: the keys/values each cross-attention uses while decoding step
by step: the same at every step, equal to the projection of the image tokens, projected once into the cache.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import Tensor, nn

from vitpipe.models.captioner import Captioner
from vitpipe.nn.attention import MultiHeadAttention
from vitpipe.tasks.doctor.check import FAIL, PASS, SKIP, TOL, Check, rel


def _caption_probe(net: Captioner, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Image tokens (memory) of a random image pair, and random words (2, max_len)."""
    like = next(net.parameters())
    enc = net.encoder
    images = torch.randn(2, enc.in_chans, *enc.img_size, generator=gen).to(like)
    words = torch.randint(0, net.vocab_size, (2, net.max_len), generator=gen).to(like.device)
    return net.encode(images), words


def check_causal(net: nn.Module, gen: torch.Generator) -> Check:
    """Logits at positions <= t against words changed after t; cached incremental decoding against the full pass."""
    if not isinstance(net, Captioner):
        return Check("causal", SKIP, None, "an image classifier has no causal decoder: every patch sees every patch")
    memory, words = _caption_probe(net, gen)
    T = words.shape[1]
    full = net.decode(words, memory)[0]  # (B, T, vocab)
    leak, leak_at = 0.0, None
    for t in range(T - 1):
        other = words.clone()
        other[:, t + 1 :] = (
            words[:, t + 1 :] + 1 + torch.randint(0, net.vocab_size - 1, (1,), generator=gen).item()
        ) % net.vocab_size  # every later word replaced by another
        d = rel(net.decode(other, memory)[0][:, : t + 1], full[:, : t + 1])
        if d > leak:
            leak, leak_at = d, t
    state = net.init_state(memory)
    first = min(3, T)  # a chunk first (the prefix decoder's image + words call), then one word per step
    steps = [net.decode(words[:, :first], memory, state=state)[0]]
    steps += [net.decode(words[:, i : i + 1], memory, state=state)[0] for i in range(first, T)]
    cached = torch.cat(steps, dim=1)
    drift = rel(cached, full)
    per_step = [rel(cached[:, i], full[:, i]) for i in range(T)]
    measured = (
        f"changing later words moves earlier logits by {leak:.1e}; cached decoding differs from the full "
        f"pass by {drift:.1e} ({T} positions, decoder={net.decoder})"
    )
    value = max(leak, drift)
    if leak > TOL:
        return Check(
            "causal",
            FAIL,
            value,
            measured,
            f"the logits at position {leak_at} depend on words after it: future tokens leak; look at the "
            "decoder's self-attention mask (DecoderBlock is_causal, vitpipe.nn.attention.causal_mask, the "
            "prefix decoder's prefix_lm_mask)",
        )
    if drift > TOL:
        bad = next(i for i, d in enumerate(per_step) if d > TOL)
        return Check(
            "causal",
            FAIL,
            value,
            measured,
            f"with the KV cache, position {bad} comes out differently from the full pass: the cached path "
            "misaligns; look at causal_mask for n_query < n_key (a mask built for the full length and "
            "reused is aligned top-left), KVCache.append and the text positions from state.length",
        )
    return Check("causal", PASS, value, measured)


# --------------------------------------------------------------------------- 4. cross-attention keys/values


class _Recorder:
    """Records the keys and values each call of one attention module's core receives (this probe only)."""

    def __init__(self, attn: MultiHeadAttention) -> None:
        self.attn, self.kv = attn, []

    def __enter__(self):
        core = type(self.attn)._attend.__get__(self.attn)

        def attend(q, k, v, *args, **kwargs):
            self.kv.append((k, v))
            return core(q, k, v, *args, **kwargs)

        self.attn._attend = attend  # an instance attribute, removed on exit: the class is untouched
        return self

    def __exit__(self, *exc):
        del self.attn._attend
        return False


def project_context(attn: MultiHeadAttention, context: Tensor) -> tuple[Tensor, Tensor]:
    """The keys and values a cross-attention must use for ``context`` (B, M, C): each (B, heads, M, head_dim)."""
    B, M, _ = context.shape
    k, v = attn.kv(context).view(B, M, 2, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    return attn.k_norm(k), v


def check_cross_kv(net: nn.Module, gen: torch.Generator) -> Check:
    """During incremental decoding, each cross-attention's keys/values: constant, the image's, cached once."""
    if not isinstance(net, Captioner):
        return Check("cross_kv", SKIP, None, "an image classifier has no cross-attention")
    if net.decoder != "cross":
        return Check(
            "cross_kv",
            SKIP,
            None,
            f"decoder={net.decoder} has no cross-attention: the image tokens are a prefix of its self-attention",
        )
    memory, words = _caption_probe(net, gen)
    M = memory.shape[1]
    state = net.init_state(memory)
    with ExitStack() as stack:
        recorders = [stack.enter_context(_Recorder(blk.cross_attn)) for blk in net.blocks]
        for i in range(words.shape[1]):  # one word per step, as generate() decodes
            net.decode(words[:, i : i + 1], memory, state=state)
    moved, off, wrong = 0.0, 0.0, []
    for i, (blk, r, cache) in enumerate(zip(net.blocks, recorders, state.cross_caches, strict=True)):
        if len(r.kv) != words.shape[1]:  # the decoder went around this cross-attention
            return Check(
                "cross_kv",
                FAIL,
                None,
                f"block {i}'s cross-attention ran {len(r.kv)} times in {words.shape[1]} steps",
                "look at DecoderBlock.forward: each step attends to the image once",
            )
        k_ref, v_ref = project_context(blk.cross_attn, memory)
        (k0, v0), later = r.kv[0], r.kv[1:]
        moved = max([moved, *(max(rel(k, k0), rel(v, v0)) for k, v in later)])
        off = max(off, rel(k0, k_ref), rel(v0, v_ref))
        if cache.length != M:
            wrong.append(f"block {i}: {cache.length}")
    measured = (
        f"keys/values move by {moved:.1e} across {words.shape[1]} steps and differ from the projected image tokens by "
        f"{off:.1e} ({len(net.blocks)} blocks, {M} image tokens)"
    )
    value = max(moved, off)
    if moved > TOL or off > TOL:
        what = "change from step to step" if moved > TOL else "are not the projection of the image tokens"
        return Check(
            "cross_kv",
            FAIL,
            value,
            measured,
            f"the cross-attention keys/values {what}: they are computed from the decoder state, not from "
            "the image; look at MultiHeadAttention._cross_qkv (K, V from context, projected once into the "
            "KVCache) and the context DecoderBlock passes",
        )
    if wrong:
        return Check(
            "cross_kv",
            FAIL,
            value,
            measured,
            f"the cross-attention caches hold {', '.join(wrong)} keys instead of the {M} image tokens: the "
            "image is re-projected every step instead of once; look at MultiHeadAttention._cross_qkv's use "
            "of the KVCache",
        )
    return Check("cross_kv", PASS, value, measured)

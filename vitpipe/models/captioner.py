"""Image captioner: a ViT encoder and a small autoregressive text decoder.

Two decoders share everything but how text sees the image:

- ``decoder="cross"``: each block is causal self-attention over the words, then cross-attention
  to the ViT tokens (the "Show, Attend and Tell" idea, Xu et al. 2015, in transformer form).
- ``decoder="prefix"``: no cross-attention at all. The ViT tokens, projected to the decoder
  width, are a prefix of the sequence [image; text]; one self-attention runs over it with a
  prefix-LM mask (Raffel et al. 2020, T5 section 3.2.1; SimVLM, Wang et al. 2022): image tokens
  see each other fully, text tokens see every image token and the words before them.

Words know their order from an absolute table (``text_pos``), from T5's relative position bias on the
self-attention logits (``text_rel_pos="t5"``, Raffel et al. 2020: one learned bucketed table shared by
every layer, ``vitpipe.nn.rel_pos_text``), or both. Under ``"t5"`` the absolute table is off unless
``text_pos`` asks for one, as T5 has none.

Input and output word embeddings are tied (Press & Wolf 2017). ``generate`` decodes greedily or
with beam search through a KV cache (one ``KVCache`` per attention), so each step costs one token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitpipe.errors import ConfigError, check_int
from vitpipe.models.vit import ViT
from vitpipe.nn.attention import KVCache
from vitpipe.nn.blocks import DecoderBlock
from vitpipe.nn.pos_embed import sincos_1d
from vitpipe.nn.rel_pos_text import REL_POS_TEXT_KINDS, T5RelativeBias, exact_buckets

DECODERS = ("cross", "prefix")
TEXT_POS = ("learned", "sincos", "none")


@dataclass
class DecodeState:
    """What incremental decoding carries between steps: the image memory and one cache per attention."""

    memory: Tensor  # (B, M, C): ViT tokens (cross) or projected prefix (prefix)
    self_caches: list[KVCache]
    cross_caches: list[KVCache]
    length: int = 0  # text positions consumed so far

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search re-ranks hypotheses every step)."""
        self.memory = self.memory.index_select(0, index)
        for c in (*self.self_caches, *self.cross_caches):
            c.reorder(index)


def build_encoder(encoder: ViT | Mapping | str) -> ViT:
    """A ViT as given, or built by ``create_model``: a registry name, or a dict with ``name`` and overrides.
    A built encoder has no classification head (``num_classes=0``) unless the dict says otherwise."""
    if isinstance(encoder, nn.Module):
        return encoder
    from vitpipe.models.registry import create_model

    if isinstance(encoder, str):
        return create_model(encoder, num_classes=0)
    if isinstance(encoder, Mapping) and "name" in encoder:
        kw = {"num_classes": 0, **{k: v for k, v in encoder.items() if k != "name"}}
        return create_model(encoder["name"], **kw)
    raise ConfigError(f"encoder must be a ViT, a registry name or a dict with a 'name' key, got {encoder!r}")


class Captioner(nn.Module):
    """``forward(images (B, C, H, W), tokens (B, T)) -> logits (B, T, vocab_size)`` (teacher forcing:
    the logits at position i predict token i + 1 and depend on tokens[:, : i + 1] only).

    Args:
        encoder: a ``ViT``, a registry name (``"vit_micro"``) or a dict ``{name, **overrides}``.
        encoder_ckpt: weights for the encoder: a classification Lightning checkpoint (``net.`` keys),
            a ``.safetensors``/``.pth`` file or a timm name (``vitpipe.models.weights.load_pretrained``).
        freeze_encoder: train the decoder only.
        vocab_size, pad_id, bos_id, eos_id: from the data module's ``model_kwargs()``.
        dim, depth, num_heads, mlp_ratio: the decoder's width, blocks, heads, MLP ratio.
        max_len: text positions (the longest sequence the decoder reads, <bos> included).
        text_pos: absolute positions of the words: ``"learned"`` table, fixed ``"sincos"`` (Vaswani et al.
            2017) or ``"none"``; ``None``: ``"learned"``, or ``"none"`` under ``text_rel_pos="t5"``.
        text_rel_pos: ``"none"`` or ``"t5"``: T5's bucketed relative bias on the decoder's self-attention
            over the words (causal buckets), one table for all layers. Under ``decoder="prefix"`` image
            tokens have no text position: pairs involving them get no bias.
        text_rel_pos_buckets, text_rel_pos_max_distance: T5's ``relative_attention_num_buckets`` and
            ``relative_attention_max_distance`` (T5: 32 and 128).
        decoder: ``"cross"`` or ``"prefix"`` (see the module docstring).
    """

    def __init__(
        self,
        *,
        encoder: ViT | Mapping | str,
        vocab_size: int,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        dim: int = 128,
        depth: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        max_len: int = 32,
        text_pos: str | None = None,
        text_rel_pos: str = "none",
        text_rel_pos_buckets: int = 32,
        text_rel_pos_max_distance: int = 128,
        decoder: str = "cross",
        qkv_bias: bool = True,
        qk_norm: bool = False,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        encoder_ckpt: str | None = None,
        freeze_encoder: bool = False,
    ) -> None:
        super().__init__()
        if decoder not in DECODERS:
            raise ConfigError(f"unknown decoder={decoder!r}; valid choices: {', '.join(DECODERS)}")
        if text_rel_pos not in REL_POS_TEXT_KINDS:
            raise ConfigError(f"unknown text_rel_pos={text_rel_pos!r}; valid choices: {', '.join(REL_POS_TEXT_KINDS)}")
        if text_pos is None:  # T5 has no absolute positions: the relative bias alone orders the words
            text_pos = "none" if text_rel_pos == "t5" else "learned"
        if text_pos not in TEXT_POS:
            raise ConfigError(f"unknown text_pos={text_pos!r}; valid choices: {', '.join(TEXT_POS)}")
        if text_rel_pos == "t5":
            check_int(text_rel_pos_buckets, "text_rel_pos_buckets", minimum=2)
            check_int(text_rel_pos_max_distance, "text_rel_pos_max_distance", minimum=1)
            if text_rel_pos_max_distance <= (exact := exact_buckets(text_rel_pos_buckets, bidirectional=False)):
                raise ConfigError(
                    f"text_rel_pos_max_distance={text_rel_pos_max_distance} must exceed the {exact} exact "
                    f"buckets of text_rel_pos_buckets={text_rel_pos_buckets} (T5: 32 buckets, 128)"
                )
        if not (min(pad_id, bos_id, eos_id) >= 0 and max(pad_id, bos_id, eos_id) < vocab_size):
            raise ConfigError(f"pad_id={pad_id}, bos_id={bos_id}, eos_id={eos_id} must lie in [0, vocab_size={vocab_size})")
        self.encoder = build_encoder(encoder)
        if encoder_ckpt:
            from vitpipe.models.weights import load_pretrained

            load_pretrained(self.encoder, encoder_ckpt)
        if freeze_encoder:
            self.encoder.requires_grad_(False)
        enc_dim = self.encoder.dim
        self.vocab_size, self.pad_id, self.bos_id, self.eos_id = vocab_size, pad_id, bos_id, eos_id
        self.dim, self.depth, self.max_len, self.decoder, self.text_pos = dim, depth, max_len, decoder, text_pos
        self.text_rel_pos = text_rel_pos

        # ViT tokens are normed only under pool="cls" (timm moves the norm after pooling for "mean"),
        # so the memory gets its own norm either way
        self.memory_norm = nn.LayerNorm(enc_dim, eps=1e-6)
        self.prefix_proj = nn.Linear(enc_dim, dim) if decoder == "prefix" else None
        self.tok_embed = nn.Embedding(vocab_size, dim)
        if text_pos == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, max_len, dim))
        elif text_pos == "sincos":
            self.register_buffer("pos_embed", sincos_1d(max_len, dim)[None], persistent=False)  # (1, max_len, dim)
        else:
            self.pos_embed = None
        # T5 (HF's has_relative_attention_bias): one table in the first layer, its bias handed to every layer;
        # causal buckets, as the decoder never sees a later word
        self.rel_pos = None
        if text_rel_pos == "t5":
            self.rel_pos = T5RelativeBias(num_heads, num_buckets=text_rel_pos_buckets, max_distance=text_rel_pos_max_distance)
        self.drop = nn.Dropout(drop_rate)
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(
            DecoderBlock(dim, num_heads, context_dim=enc_dim if decoder == "cross" else None, mlp_ratio=mlp_ratio,
                         qkv_bias=qkv_bias, qk_norm=qk_norm, proj_drop=drop_rate, attn_drop=attn_drop_rate, drop_path=r)
            for r in rates
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self._init_weights()
        self.head.weight = self.tok_embed.weight  # tied (Press & Wolf 2017): one table reads and writes words

    def _init_weights(self) -> None:
        # GPT-2/timm: truncated normal .02 for linears and tables; the encoder keeps its own (or loaded) weights
        for name, m in self.named_modules():
            if name.startswith("encoder"):
                continue
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """Parameter names weight decay must skip (besides norms and biases)."""
        names = {f"encoder.{n}" for n in self.encoder.no_weight_decay()}
        names |= {"rel_pos.relative_attention_bias.weight"} if self.rel_pos is not None else set()  # as ViT's tables
        return names | ({"pos_embed"} if isinstance(self.pos_embed, nn.Parameter) else set())

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.encoder.grid_size

    @property
    def num_prefix_tokens(self) -> int:
        """Leading non-patch tokens among the M image tokens (class token, registers)."""
        return self.encoder.num_prefix_tokens

    # ---------------------------------------------------------------- encoder / decoder

    def encode(self, images: Tensor) -> Tensor:
        """(B, C, H, W) -> memory (B, M, enc_dim) for "cross", (B, M, dim) for "prefix"."""
        memory = self.memory_norm(self.encoder.forward_features(images))
        return memory if self.prefix_proj is None else self.prefix_proj(memory)

    def init_state(self, memory: Tensor) -> DecodeState:
        cross = [KVCache() for _ in self.blocks] if self.decoder == "cross" else []
        return DecodeState(memory, [KVCache() for _ in self.blocks], cross)

    def decode(self, tokens: Tensor, memory: Tensor, *, state: DecodeState | None = None,
               key_padding_mask: Tensor | None = None, need_weights: bool = False):
        """Run the decoder over ``tokens`` (B, T).

        Without ``state``: the whole sequence from position 0 (teacher forcing). With ``state``:
        the tokens continue the sequence at ``state.length`` and the caches grow (incremental).
        key_padding_mask: (B, T) bool, True = <pad>; full sequences only.
        Returns logits (B, T, vocab) and, when ``need_weights``, the attention of each text
        position onto the M image tokens, (B, depth, heads, T, M); else None.
        """
        B, T = tokens.shape
        start = 0 if state is None else state.length
        if start + T > self.max_len:
            raise ValueError(f"text positions {start}..{start + T - 1} exceed the decoder's max_len={self.max_len}")
        if state is not None and key_padding_mask is not None:
            raise ValueError("key_padding_mask applies to full sequences only, not to incremental decoding")
        x = self.tok_embed(tokens)  # (B, T, dim)
        x = self.drop(x if self.pos_embed is None else x + self.pos_embed[:, start : start + T])

        M = memory.shape[1]
        prefix = self.decoder == "prefix"
        P = M if prefix and start == 0 else 0  # prefix tokens entering in this call
        if P:
            x = torch.cat([memory, x], dim=1)  # (B, M + T, dim)
            if key_padding_mask is not None:
                key_padding_mask = torch.cat([key_padding_mask.new_zeros(B, M), key_padding_mask], dim=1)
        attn_mask = None  # None: the block's own causal mask
        if prefix:
            past = 0 if state is None else state.self_caches[0].length
            attn_mask = prefix_lm_mask(x.shape[1], past + x.shape[1], M, device=x.device)
        attn_bias = None
        if self.rel_pos is not None:  # words at start .. start + T - 1 against words 0 .. start + T - 1
            attn_bias = self.rel_pos(T, start + T, past=start)  # (1, heads, T, start + T)
            if prefix:  # the image has no place in the text: zero bias to and from the M prefix tokens
                attn_bias = F.pad(attn_bias, [M, 0, P, 0])  # (1, heads, P + T, M + start + T)

        weights = []
        for i, blk in enumerate(self.blocks):
            out = blk(x, None if prefix else memory, attn_mask=attn_mask, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                      self_cache=None if state is None else state.self_caches[i],
                      cross_cache=None if state is None or prefix else state.cross_caches[i], need_weights=need_weights)
            if need_weights:
                x, w_self, w_cross = out
                weights.append(w_self[:, :, P:, :M] if prefix else w_cross)  # (B, heads, T, M)
            else:
                x = out
        if state is not None:
            state.length = start + T
        logits = self.head(self.norm(x[:, P:]))  # (B, T, vocab)
        return logits, (torch.stack(weights, dim=1) if need_weights else None)

    def forward(self, images: Tensor, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.decode(tokens, self.encode(images), key_padding_mask=key_padding_mask)[0]

    # ---------------------------------------------------------------- search

    @torch.no_grad()
    def generate(self, images: Tensor, *, max_len: int | None = None, beam_size: int = 1,
                 length_penalty: float = 1.0, return_cross_attn: bool = False):
        """Caption ``images`` (B, C, H, W). Greedy for ``beam_size=1``, else beam search.

        Beams are ranked by summed log-probability while searching; a beam that emitted <eos>
        stays in the beam with a frozen score (it only extends with <pad> at no cost). The final
        pick divides each score by ``length ** length_penalty`` (length counts <eos>; 0 = raw sum,
        1 = mean log-probability per token, as Wu et al. 2016's normalisation without the +5 offset).
        max_len: words to generate at most, <eos> included; default the decoder's ``max_len``.
        Returns ids (B, T) after <bos>, <pad> after <eos>; with ``return_cross_attn`` also
        (B, depth, heads, T, M): each generated word's attention over the M image tokens (zeros after <eos>).
        """
        max_len = self.max_len if max_len is None else max_len
        if not 1 <= max_len <= self.max_len:
            raise ConfigError(f"max_len={max_len} must lie in [1, the decoder's max_len={self.max_len}]")
        if beam_size < 1:
            raise ConfigError(f"beam_size={beam_size} must be >= 1")
        B, K, V = images.shape[0], beam_size, self.vocab_size
        state = self.init_state(self.encode(images).repeat_interleave(K, dim=0))  # rows b*K + k
        scores = torch.zeros(B, K, device=images.device)
        scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
        finished = torch.zeros(B * K, dtype=torch.bool, device=images.device)
        lengths = torch.zeros(B * K, device=images.device)
        seq = torch.empty(B * K, 0, dtype=torch.long, device=images.device)
        attn = None
        word = torch.full((B * K, 1), self.bos_id, dtype=torch.long, device=images.device)
        base = torch.arange(B, device=images.device)[:, None] * K  # (B, 1)

        for _ in range(max_len):
            logits, w = self.decode(word, state.memory, state=state, need_weights=return_cross_attn)
            logp = logits[:, -1].float().log_softmax(dim=-1)  # (B*K, V)
            logp[finished] = float("-inf")
            logp[finished, self.pad_id] = 0.0
            scores, idx = (scores.view(-1, 1) + logp).view(B, K * V).topk(K, dim=1)  # (B, K)
            rows = (base + idx // V).view(-1)  # (B*K,) the beam each new hypothesis extends
            word = (idx % V).view(-1, 1)  # (B*K, 1)
            state.reorder(rows)
            was_done = finished[rows]
            seq = torch.cat([seq[rows], word], dim=1)
            lengths = lengths[rows] + (~was_done).float()
            finished = was_done | (word[:, 0] == self.eos_id)
            if return_cross_attn:
                w = w[rows].masked_fill(was_done.view(-1, 1, 1, 1, 1), 0.0)  # (B*K, depth, heads, 1, M)
                attn = w if attn is None else torch.cat([attn[rows], w], dim=3)
            if finished.all():
                break

        best = (scores / lengths.view(B, K).clamp(min=1) ** length_penalty).argmax(dim=1)  # (B,)
        pick = base[:, 0] + best
        tokens = seq[pick]
        return (tokens, attn[pick]) if return_cross_attn else tokens


def prefix_lm_mask(n_query: int, n_key: int, prefix_len: int, device=None) -> Tensor:
    """Bool (n_query, n_key), True = may attend: causal, except that the first ``prefix_len``
    positions (the image) are visible to every query. Queries are the last ``n_query`` positions,
    so the same rule serves a full pass and a cached step."""
    q = torch.arange(n_key - n_query, n_key, device=device)[:, None]  # absolute query positions
    k = torch.arange(n_key, device=device)[None, :]
    return (k <= q) | (k < prefix_len)

"""Word-level caption tokenizer, built from the training captions.

Captioning vocabularies in the show-and-tell line of work (Vinyals et al. 2015; Karpathy &
Fei-Fei 2015) are word lists: lowercase, punctuation split off, rare words mapped to <unk>.
The vocabulary is small state (a list of words), so it travels inside the Lightning checkpoint
(``state_dict()``) and a checkpoint decodes on its own.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: <pad> = 0 so zero-initialised buffers read as padding

# a word is a run of letters, digits and apostrophes (any script); any other non-space
# character is a token of its own
WORD = re.compile(r"[\w']+")
_TOKEN = re.compile(r"[\w']+|[^\w\s]")


def split_words(text: str) -> list[str]:
    """Lowercase and split punctuation off: ``"A red, round ball."`` -> ``a red , round ball .``"""
    return _TOKEN.findall(text.lower())


class WordTokenizer:
    """Maps captions to ids and back. ``itos`` is the whole state: index = id."""

    def __init__(self, itos: Sequence[str]) -> None:
        if tuple(itos[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"the vocabulary must start with the specials {SPECIALS}, got {list(itos[:4])}")
        self.itos = list(itos)
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("the vocabulary holds a word twice")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = range(len(SPECIALS))

    @classmethod
    def build(cls, captions: Iterable[str], *, min_freq: int = 1, max_size: int | None = None) -> WordTokenizer:
        """Vocabulary of the words seen at least ``min_freq`` times, most frequent first (ties
        alphabetical, so the same captions always give the same ids)."""
        counts = Counter(w for c in captions for w in split_words(c))
        words = sorted((w for w, n in counts.items() if n >= min_freq and w not in SPECIALS),
                       key=lambda w: (-counts[w], w))
        return cls([*SPECIALS, *words[:max_size]])

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = [self.stoi.get(w, self.unk_id) for w in split_words(text)]
        return [self.bos_id, *ids, self.eos_id] if add_special else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Words up to the first <eos>, specials dropped."""
        words = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(SPECIALS) or i == self.unk_id:
                words.append(self.itos[i])
        return " ".join(words)

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None) -> Tensor:
        """(B, T) long: <bos> words <eos>, right-padded with <pad>. ``max_len`` caps T (the cut
        keeps <bos> and drops the <eos> of over-long captions, as truncation must)."""
        seqs = [self.encode(t) for t in texts]
        if max_len is not None:
            seqs = [s[:max_len] for s in seqs]
        out = torch.full((len(seqs), max(map(len, seqs), default=0)), self.pad_id, dtype=torch.long)
        for row, s in zip(out, seqs):
            row[: len(s)] = torch.tensor(s)
        return out

    def batch_decode(self, ids: Tensor) -> list[str]:
        """(B, T) ids (with or without a leading <bos>) -> B strings."""
        return [self.decode(row) for row in ids.tolist()]

    def state_dict(self) -> dict:
        return {"itos": list(self.itos)}

    @classmethod
    def from_state_dict(cls, state: dict) -> WordTokenizer:
        return cls(state["itos"])

    def __len__(self) -> int:
        return len(self.itos)

    def __repr__(self) -> str:
        return f"WordTokenizer(vocab_size={self.vocab_size})"

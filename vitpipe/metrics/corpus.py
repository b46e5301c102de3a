"""Corpus-level caption metrics as torchmetrics ``Metric``s wrapping pycocoevalcap's scorers.

BLEU and CIDEr-D are *corpus* statistics: BLEU sums n-gram matches over all captions before the
ratio, and CIDEr-D's IDF weights come from the references of the whole evaluated set. Neither
is a mean of per-batch scores, so the metric keeps every caption until ``compute()``.

DDP: the captions are kept as UTF-8 bytes in uint8 tensors (``dist_reduce_fx="cat"``) with
their lengths, so torchmetrics' own all-gather syncs them across ranks (ragged sizes allowed)
and every rank scores the same full corpus. We chose bytes over token ids so the metric does
not depend on a vocabulary, and over ``all_gather_object`` so ``merge_state``, ``forward`` and
``sync`` all work through the standard state machinery. Note: a ``DistributedSampler`` pads the
last batch by repeating samples and those repeats would be scored (as in any torchmetrics metric);
vitpipe's caption data modules shard evaluation without padding (``ShardedSampler``), so each image
is scored once.

Text is normalised as coco-caption does before scoring (its PTBTokenizer lowercases and drops
punctuation); we do it in Python with ``split_words`` minus punctuation tokens, so no Java is
needed. pycocoevalcap's BLEU and CIDEr are pure Python; METEOR and SPICE need Java and are not used.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from vitpipe.text.tokenizer import WORD, split_words


def coco_scorer(module: str, name: str):
    """A pycocoevalcap scorer class, imported on first use so that ``import vitpipe`` works without
    the captioning extra."""
    try:
        return getattr(importlib.import_module(f"pycocoevalcap.{module}"), name)
    except ImportError as e:
        raise ImportError("caption metrics need pycocoevalcap: pip install 'vitpipe[caption]'") from e


def normalize(text: str) -> str:
    """coco-caption's pre-scoring step: lowercase, words only (punctuation tokens dropped)."""
    return " ".join(w for w in split_words(text) if WORD.fullmatch(w))


def _to_bytes(texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    raw = [t.encode("utf-8") for t in texts]
    flat = torch.tensor(np.frombuffer(b"".join(raw), dtype=np.uint8))  # copies, (sum of lengths,)
    return flat, torch.tensor([len(r) for r in raw], dtype=torch.long)


def _from_bytes(flat: Tensor, lengths: Tensor) -> list[str]:
    data, out, start = flat.cpu().numpy().tobytes(), [], 0
    for n in lengths.tolist():
        out.append(data[start : start + n].decode("utf-8"))
        start += n
    return out


class CaptionCorpus(Metric):
    """Collects (hypothesis, references) pairs; subclasses score the corpus in ``_score``.

    ``update(preds: list[str], target: list[list[str]])``: one hypothesis and its (any number
    of, at least one) references per image.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("pred_bytes", "pred_lens", "ref_bytes", "ref_lens", "ref_counts"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, preds: Sequence[str], target: Sequence[Sequence[str]]) -> None:
        if len(preds) != len(target):
            raise ValueError(f"got {len(preds)} predictions but {len(target)} reference lists")
        if any(len(refs) == 0 for refs in target):
            raise ValueError("every prediction needs at least one reference caption")
        flat, lens = _to_bytes([normalize(p) for p in preds])
        self.pred_bytes.append(flat.to(self.device))
        self.pred_lens.append(lens.to(self.device))
        flat, lens = _to_bytes([normalize(r) for refs in target for r in refs])
        self.ref_bytes.append(flat.to(self.device))
        self.ref_lens.append(lens.to(self.device))
        self.ref_counts.append(torch.tensor([len(refs) for refs in target], dtype=torch.long, device=self.device))

    def corpus(self) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
        """(gts, res) in pycocoevalcap's format: {i: [refs...]}, {i: [hypothesis]}."""
        # after a sync a rank that saw no data contributes torchmetrics' float ``tensor([])``; the
        # casts undo that promotion
        def cat(state, dtype):
            return dim_zero_cat(state).to(dtype) if len(state) else torch.zeros(0, dtype=dtype)

        preds = _from_bytes(cat(self.pred_bytes, torch.uint8), cat(self.pred_lens, torch.long))
        refs = _from_bytes(cat(self.ref_bytes, torch.uint8), cat(self.ref_lens, torch.long))
        counts = cat(self.ref_counts, torch.long).tolist()
        gts, res, start = {}, {}, 0
        for i, (p, n) in enumerate(zip(preds, counts)):
            gts[i], res[i] = refs[start : start + n], [p]
            start += n
        return gts, res

    def compute(self):
        gts, res = self.corpus()
        if not res:
            raise RuntimeError(f"{type(self).__name__}.compute() called before any update()")
        return self._score(gts, res)

    def _score(self, gts: dict, res: dict):
        raise NotImplementedError

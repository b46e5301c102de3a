"""Corpus BLEU-1..4 (Papineni et al. 2002) as coco-caption computes it."""

from __future__ import annotations

import torch
from torch import Tensor

from vitpipe.metrics.corpus import CaptionCorpus, coco_scorer


def bleu_score(gts: dict, res: dict, n: int = 4) -> Tensor:
    """BLEU-1..n over the corpus, all references per image, "closest" reference length for the
    brevity penalty (pycocoevalcap's ``Bleu``). Returns float64 (n,)."""
    scores, _ = coco_scorer("bleu.bleu", "Bleu")(n).compute_score(gts, res, verbose=0)
    return torch.tensor(scores, dtype=torch.float64)


class CocoBLEU(CaptionCorpus):
    """``compute()`` -> (n,) tensor: BLEU-1 .. BLEU-n of everything passed to ``update``."""

    def __init__(self, n: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.n = n

    def _score(self, gts: dict, res: dict) -> Tensor:
        return bleu_score(gts, res, self.n)

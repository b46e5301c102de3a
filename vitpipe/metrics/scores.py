"""BLEU-1..4 and CIDEr-D from one collected corpus (one gather, one copy of the captions)."""

from __future__ import annotations

from vitpipe.metrics.bleu import bleu_score
from vitpipe.metrics.cider import cider_d_score
from vitpipe.metrics.corpus import CaptionCorpus


class CaptionScores(CaptionCorpus):
    """``compute()`` -> {"bleu1", ..., "bleu4", "cider"}: what the captioning module logs per split."""

    def _score(self, gts: dict, res: dict) -> dict:
        bleu = bleu_score(gts, res, 4)
        return {**{f"bleu{k + 1}": b for k, b in enumerate(bleu)}, "cider": cider_d_score(gts, res)}

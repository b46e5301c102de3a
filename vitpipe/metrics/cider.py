"""CIDEr-D (Vedantam et al. 2015, "CIDEr: Consensus-based Image Description Evaluation").

pycocoevalcap's ``Cider`` class *is* CIDEr-D, the variant the COCO server reports: it clips the
hypothesis' n-gram tf-idf at the reference's (``min(vec_hyp, vec_ref)``), multiplies by a
Gaussian length penalty (sigma = 6), does no stemming and scales by 10 (checked in
pycocoevalcap 1.2, ``cider/cider_scorer.py``; that package has no separate ``CiderD``). The IDF
comes from the references of the evaluated corpus, so the score depends on the whole set.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vitpipe.metrics.corpus import CaptionCorpus, coco_scorer


def cider_d_score(gts: dict, res: dict, sigma: float = 6.0) -> Tensor:
    """Corpus CIDEr-D: mean over images of the clipped, length-penalised tf-idf cosine, x10."""
    score, _ = coco_scorer("cider.cider", "Cider")(sigma=sigma).compute_score(gts, res)
    return torch.tensor(float(score), dtype=torch.float64)


class CocoCIDErD(CaptionCorpus):
    """``compute()`` -> scalar CIDEr-D of everything passed to ``update``."""

    def __init__(self, sigma: float = 6.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sigma = sigma

    def _score(self, gts: dict, res: dict) -> Tensor:
        return cider_d_score(gts, res, self.sigma)

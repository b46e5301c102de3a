"""Captioning metrics (BLEU-1..4, CIDEr-D) as DDP-safe torchmetrics over pycocoevalcap."""

from vitpipe.metrics.bleu import CocoBLEU, bleu_score
from vitpipe.metrics.cider import CocoCIDErD, cider_d_score
from vitpipe.metrics.corpus import CaptionCorpus, normalize
from vitpipe.metrics.scores import CaptionScores

__all__ = ["CaptionCorpus", "CaptionScores", "CocoBLEU", "CocoCIDErD", "bleu_score", "cider_d_score", "normalize"]

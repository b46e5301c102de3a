"""Captioning (``module=captioner``): an image encoder and a text decoder; ``net.generate`` writes
captions, scored by BLEU and CIDEr-D (vitpipe.lit.captioner owns the loop). No class probabilities."""

from vitpipe.kinds.base import TaskKind


class Captioning(TaskKind):
    name = "captioning"
    words = "captioner"
    module_target = "vitpipe.lit.captioner.CaptionModule"
    generates = True

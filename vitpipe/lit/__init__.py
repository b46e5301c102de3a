from vitpipe.lit.captioner import CaptionModule
from vitpipe.lit.classifier import ImageClassifier

__all__ = ["CaptionModule", "ImageClassifier"]

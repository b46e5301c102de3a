from vitpipe.lit.classifier import ImageClassifier

__all__ = ["ImageClassifier"]

"""Text side of captioning: the word tokenizer."""

from vitpipe.text.tokenizer import WordTokenizer, split_words

__all__ = ["WordTokenizer", "split_words"]

"""What every captioning data set shares: a dataset of (image, references), the collate that
tokenizes, and a LightningDataModule that builds the tokenizer from the training captions.

Batches are dicts:
    images    (B, C, H, W) float, normalised
    tokens    (B, T) long: <bos> words <eos> <pad>...; one reference per image (a random one in
              training, so every reference is seen over the epochs; the first one otherwise)
    image_ids (B,) long: the data set's own image ids (COCO ids, or the index for shapes)
    refs      list of B lists of str: all reference captions, for BLEU / CIDEr-D
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vitpipe.data.resume import loader_generator
from vitpipe.data.sampler import ShardedSampler, rank_layout
from vitpipe.data.workers import local_world_size, resolve_num_workers
from vitpipe.errors import ConfigError
from vitpipe.text.tokenizer import WordTokenizer

SPLITS = ("train", "val", "test")


class CaptionDataset(Dataset):
    """``image(i) -> (C, H, W)`` float tensor; ``refs[i]`` the reference captions of image i."""

    def __init__(self, image: Callable[[int], Tensor], refs: Sequence[Sequence[str]], image_ids: Sequence[int],
                 *, sample_caption: bool) -> None:
        self.image, self.refs, self.image_ids, self.sample_caption = image, refs, list(image_ids), sample_caption

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int) -> dict:
        refs = list(self.refs[i])
        k = int(torch.randint(len(refs), ())) if self.sample_caption else 0
        return {"image": self.image(i), "caption": refs[k], "refs": refs, "image_id": self.image_ids[i]}


class CaptionCollate:
    """Stacks images and tokenizes the chosen captions (a class, so worker processes can pickle it)."""

    def __init__(self, tokenizer: WordTokenizer, max_len: int) -> None:
        self.tokenizer, self.max_len = tokenizer, max_len

    def __call__(self, items: list[dict]) -> dict:
        return {
            "images": torch.stack([it["image"] for it in items]),  # (B, C, H, W)
            "tokens": self.tokenizer.batch_encode([it["caption"] for it in items], max_len=self.max_len),  # (B, T)
            "image_ids": torch.tensor([it["image_id"] for it in items], dtype=torch.long),
            "refs": [it["refs"] for it in items],
        }


class CaptionDataModule(L.LightningDataModule):
    """Subclasses implement ``_load(split) -> (image_fn, refs, image_ids)``.

    ``channels`` is the static value the config carries so ``model.encoder.in_chans`` can follow it.
    ``seed`` fixes each epoch's training order (vitpipe.data.sampler; a function of (seed, epoch)).

    The tokenizer is built on first use from the training captions (``model_kwargs()`` needs the
    vocabulary before the model exists), or set from a checkpoint (``dm.tokenizer = ...``) so an
    evaluation uses the vocabulary the model was trained with.
    """

    channels = 3  # both caption sets are colour images

    def __init__(self, *, channels: int = 3, batch_size: int = 64, eval_batch_size: int | None = None,
                 num_workers: int | None = 0, max_len: int = 32, min_word_freq: int = 1,
                 pin_memory: bool = False, seed: int = 0) -> None:
        super().__init__()
        if channels != self.channels:
            raise ConfigError(f"data.channels={channels} but {type(self).__name__} images have {self.channels} channels")
        if max_len < 3:
            raise ConfigError(f"data max_len={max_len} leaves no room for a word between <bos> and <eos>; use >= 3")
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size} must be >= 1")
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.max_len, self.min_word_freq, self.pin_memory = num_workers, max_len, min_word_freq, pin_memory
        self.seed = int(seed)  # the training order of each epoch (and, for generated sets, the data)
        self._tokenizer: WordTokenizer | None = None
        self._data: dict[str, CaptionDataset] = {}

    def _load(self, split: str) -> tuple[Callable[[int], Tensor], Sequence[Sequence[str]], Sequence[int]]:
        raise NotImplementedError

    def train_captions(self) -> list[str]:
        return [c for refs in self._dataset("train").refs for c in refs]

    @property
    def tokenizer(self) -> WordTokenizer:
        if self._tokenizer is None:
            self._tokenizer = WordTokenizer.build(self.train_captions(), min_freq=self.min_word_freq)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: WordTokenizer) -> None:
        self._tokenizer = tokenizer

    def model_kwargs(self) -> dict:
        tok = self.tokenizer
        return {"vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id}

    def module_kwargs(self) -> dict:
        return {"tokenizer": self.tokenizer}

    def _dataset(self, split: str) -> CaptionDataset:
        if split not in self._data:
            image, refs, ids = self._load(split)
            self._data[split] = CaptionDataset(image, refs, ids, sample_caption=split == "train")
        return self._data[split]

    def setup(self, stage: str | None = None) -> None:
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in splits.get(stage, SPLITS):
            self._dataset(split)

    def _loader(self, split: str) -> DataLoader:
        train = split == "train"
        world, rank = rank_layout(self.trainer)
        # Each rank reads its own shard (Lightning injects no sampler: conf/trainer/default.yaml). Training
        # shards are padded to equal length (DDP needs equal step counts) and reshuffled per epoch from
        # (seed, epoch); evaluation shards are not padded, so every image is scored exactly once.
        sampler = ShardedSampler(len(self._dataset(split)), num_replicas=world, rank=rank, shuffle=train,
                                 seed=self.seed, pad=train)  # fmt: skip
        workers = resolve_num_workers(self.num_workers, local_world_size(self.trainer))  # None: from the CPUs
        return DataLoader(self._dataset(split), batch_size=self.batch_size if train else self.eval_batch_size,
                          sampler=sampler, drop_last=False, num_workers=workers,
                          collate_fn=CaptionCollate(self.tokenizer, self.max_len), pin_memory=self.pin_memory,
                          persistent_workers=workers > 0, generator=loader_generator(self.seed, rank))  # fmt: skip

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

"""A streamed Hugging Face split (``datasets.IterableDataset``) as fixed-length epochs of batches, per rank.

``StreamingSource``: one split, its columns and its example count. ``StreamingBatches``: what the
DataLoader iterates (it batches itself, ``batch_size=None``):

- the rank's part: ``datasets.distributed.split_dataset_by_node`` (whole shards when the shard count
  divides by the world size, else every world-th example);
- training order: the part shuffled through a buffer of ``buffer`` examples, seeded by ``seed`` and
  reseeded each epoch (``set_epoch``, or ``epoch_of``: the trainer's epoch as each pass starts);
- a fixed length: every rank yields ``ceil(count / world / batch_size)`` training batches, a part that runs
  short starting over from its head (as ``ShardedSampler`` pads), so DDP ranks step together and a
  schedule is sized from ``count``;
- resume: ``skip`` batches of the epoch are read past without decoding (``ResumeState``'s position);
- augmentation: each batch's from generators seeded by (seed, rank, epoch, batch), so the same after a resume.

Reading runs in the loading process (``DataLoader(num_workers=0)``): loader workers would each take a
share of the part's shards, and the batch a worker yields would no longer follow from the count.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import random
from itertools import islice

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from vitpipe.data.images import open_image, why_unreadable
from vitpipe.errors import ConfigError


class StreamingSource:
    def __init__(self, ds, image_column: str, label_column: str, mode: str, where: str, count: int,
                 transform=None) -> None:  # fmt: skip
        from datasets import Image

        self.ds = ds.cast_column(image_column, Image(decode=False))  # bytes/path: vitpipe decodes, or skips
        self.image_column, self.label_column, self.mode, self.where = image_column, label_column, mode, where
        self.count, self.transform = int(count), transform

    def transformed(self, transform) -> StreamingSource:
        out = copy.copy(self)
        out.transform = transform
        return out

    def batches(self, *, batch_size: int, rank: int, world: int, shuffle: bool, buffer: int,
                seed: int, train: bool) -> StreamingBatches:  # fmt: skip
        return StreamingBatches(self, batch_size=batch_size, rank=rank, world=world, shuffle=shuffle, buffer=buffer,
                                seed=seed, pad=train)

    def item(self, row: dict):
        image = decode(row[self.image_column], self.mode, self.where)
        return (self.transform(image) if self.transform else image), int(row[self.label_column])


class StreamingBatches(IterableDataset):
    def __init__(self, source: StreamingSource, *, batch_size: int, rank: int, world: int, shuffle: bool,
                 buffer: int, seed: int, pad: bool) -> None:  # fmt: skip
        self.source, self.batch_size, self.rank, self.world = source, batch_size, rank, world
        self.shuffle, self.buffer, self.seed, self.pad = shuffle, buffer, seed, pad
        self.epoch = 0
        self.epoch_of = None  # the trainer's current epoch, read as each pass starts (see set_epoch)
        self.skip = 0  # batches of the next pass read past without decoding (a resumed epoch), once

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass. Lightning calls ``set_epoch`` on a loader's sampler only, and an
        iterable data set's DataLoader has none of its own: ``epoch_of`` (a callable) wins when set."""
        self.epoch = int(epoch)

    def per_rank(self) -> int:
        """Examples this rank yields per pass: training an equal share (padded), evaluation its own part's."""
        return math.ceil(self.source.count / self.world)

    def __len__(self) -> int:
        return math.ceil(self.per_rank() / self.batch_size)

    def _part(self):
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(self.source.ds, rank=self.rank, world_size=self.world)
        if self.shuffle:
            part = part.shuffle(seed=self.seed, buffer_size=self.buffer)
            part.set_epoch(self.epoch)
        return part

    def _rows(self):
        """The part's rows; training: the part again from its head until the rank's share is full."""
        part = self._part()
        while True:
            n = 0
            for row in part:
                n += 1
                yield row
            if not self.pad:
                return
            if not n:  # would start over forever (timm's hfids reader guards the same)
                raise ConfigError(f"{self.source.where}: rank {self.rank} of {self.world} got no examples (fewer shards "
                                  "than ranks?); use fewer processes or data.streaming=false")

    def __iter__(self):
        if self.epoch_of is not None:
            self.set_epoch(self.epoch_of())
        skip, self.skip = self.skip, 0
        rows = islice(self._rows(), self.per_rank()) if self.pad else iter(self._rows())
        for b in range(len(self) if self.pad else 1 << 62):
            chunk = list(islice(rows, self.batch_size))
            if not chunk:
                return
            if b < skip:
                continue  # trained before the resume: read, never decoded
            with seeded(hash((self.seed, self.rank, self.epoch, b)) & _SEED_MASK):
                yield default_collate([self.source.item(row) for row in chunk])


_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


@contextlib.contextmanager
def seeded(seed: int):
    """The batch's augmentation drawn from generators seeded by its position, the global ones left as they
    were. Read in the training process, the crops and flips would otherwise come from the stream that
    dropout and drop-path draw from, in the order Lightning's prefetch happens to fetch: a resumed run
    (its generators restored at a step boundary, one batch already fetched before it) would augment the
    next batch differently from the run it continues."""
    state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        torch.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


def decode(value: dict, mode: str, where: str):
    """An ``Image(decode=False)`` value (``{"bytes", "path"}``) as a PIL image, naming the row when it fails."""
    try:
        if value is None:
            raise ValueError("no image")
        return open_image(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"], mode)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"cannot read the image of {where}: {why_unreadable(err, value and value.get('path'))}") \
            from err

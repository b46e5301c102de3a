"""NaFlex training data: images at their own aspect as patch sequences, batched to a token budget.

timm's NaFlex loader (``timm/data/naflex_loader.py``, ``naflex_dataset.py``), made exact for our
guarantees. Training: each batch draws a sequence length ``seq_len`` from ``seq_lens``; it holds
``tokens_per_batch // seq_len`` images per rank, each resized to its own-aspect grid of at most
``seq_len`` patches (``vitpipe.nn.naflex.patchify_image``) and padded to ``seq_len``. Evaluation:
every image once, at ``max_seq_len``.

The plan (``TokenBudgetBatchSampler``), as timm's canonical schedule: the list of steps (seq_len,
global batch size) is drawn once from ``seed`` (so every epoch has the same number of batches, which
Lightning's loop and the LR schedule rely on); each epoch permutes the images and the steps' order
by ``(seed, epoch)``. A step's images are split over the ranks ``[rank::world]``, so each training
image is seen exactly once per epoch across ranks, nothing is repeated or dropped. The remainder
(the images left after the last full step) is one smaller step; if it has fewer images than ranks it
is folded into the step before (that step then holds up to one extra image per rank).
Augmentation: a horizontal flip (``hflip``), drawn by the plan per (seed, epoch, rank, batch), so a
resumed run flips as the run it continues. No crop: the resize to the sequence grid is the only
geometric change (NaViT trains on whole images at native aspect).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, Sampler
from torchvision.transforms.v2 import functional as TF

from vitpipe.data.fast import TensorImageDataset
from vitpipe.errors import ConfigError
from vitpipe.nn.naflex import pad_batch, patchify_image, seq_grid

LOSS_SCALES = ("none", "linear", "sqrt")
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class NaFlexConfig:
    """``data.naflex``, checked. ``tokens_per_batch`` None: ``batch_size * max(seq_lens)`` (timm's)."""

    enabled: bool
    seq_lens: tuple[int, ...]
    max_seq_len: int
    tokens_per_batch: int
    loss_scale: str
    patch_size: int
    batch_size: int  # data.batch_size: the batch at max(seq_lens), the loss scale's reference

    @classmethod
    def from_cfg(cls, cfg, batch_size: int) -> NaFlexConfig | None:
        if not cfg or not cfg.get("enabled", False):
            return None
        cfg = dict(cfg)
        unknown = set(cfg) - {"enabled", "seq_lens", "max_seq_len", "tokens_per_batch", "loss_scale", "patch_size"}
        if unknown:
            raise ConfigError(f"data.naflex has unknown key(s) {sorted(unknown)}; valid: enabled, seq_lens, "
                              "max_seq_len, tokens_per_batch, loss_scale, patch_size")
        seq_lens = cfg.get("seq_lens")
        if isinstance(seq_lens, int) and not isinstance(seq_lens, bool):
            seq_lens = [seq_lens]
        try:
            seq_lens = tuple(seq_lens)
        except TypeError:
            seq_lens = ()
        if not seq_lens or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in seq_lens):
            raise ConfigError(f"data.naflex.seq_lens={cfg.get('seq_lens')!r}: use a list of ints >= 1 "
                              "(patches per image), e.g. [16, 25, 36, 49]")
        max_seq_len = cfg.get("max_seq_len")
        max_seq_len = max(seq_lens) if max_seq_len is None else max_seq_len
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < max(seq_lens):
            raise ConfigError(f"data.naflex.max_seq_len={max_seq_len!r}: use an int >= max(seq_lens)={max(seq_lens)}")
        tokens = cfg.get("tokens_per_batch")
        tokens = batch_size * max(seq_lens) if tokens is None else tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < max(seq_lens):
            raise ConfigError(f"data.naflex.tokens_per_batch={tokens!r}: use an int >= max(seq_lens)={max(seq_lens)} "
                              "(at least one image per batch) or null (data.batch_size * max(seq_lens))")
        scale = cfg.get("loss_scale", "linear")
        if scale not in LOSS_SCALES:
            raise ConfigError(f"data.naflex.loss_scale={scale!r}; valid: {', '.join(LOSS_SCALES)}")
        p = cfg.get("patch_size")
        if not isinstance(p, int) or isinstance(p, bool) or p < 1:
            raise ConfigError(f"data.naflex.patch_size={p!r}: use an int >= 1 (the model's, ${{model.patch_size}})")
        return cls(True, seq_lens, max_seq_len, tokens, scale, p, batch_size)

    def batch_size_for(self, seq_len: int) -> int:
        return max(1, self.tokens_per_batch // seq_len)


def loss_scale(batch_size: int, base_batch_size: int, mode: str) -> float:
    """timm's ``--naflex-loss-scale`` (train.py): the loss of a batch of ``batch_size`` images times
    ``batch_size / base_batch_size`` (``linear``), its square root (``sqrt``) or 1 (``none``), where
    ``base_batch_size`` is the batch at the longest sequence (``data.batch_size``). With a mean loss
    per image, ``linear`` gives every image the same weight in the gradient whatever its batch."""
    if mode == "none":
        return 1.0
    s = batch_size / base_batch_size
    return math.sqrt(s) if mode == "sqrt" else s


def _gen(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & _SEED_MASK)


class TokenBudgetBatchSampler(Sampler[list]):
    """One rank's training batches: lists of keys ``(index, seq_len, flip)`` (see the module doc).

    ``skip``: batches of the next pass to drop, once (exact mid-epoch resume). ``set_epoch`` as
    for any sampler: Lightning calls it on ``loader.sampler`` and ``loader.batch_sampler.sampler``
    only, never on the batch sampler itself, hence ``self.sampler``, which forwards it here.
    """

    def __init__(self, n: int, *, seq_lens: Sequence[int], tokens_per_batch: int, num_replicas: int = 1,
                 rank: int = 0, shuffle: bool = True, seed: int = 0, hflip: bool = False) -> None:
        super().__init__()
        if n < num_replicas:
            raise ConfigError(f"{n} training image(s) cannot give each of {num_replicas} ranks a batch")
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.seq_lens, self.tokens_per_batch = tuple(seq_lens), tokens_per_batch
        self.shuffle, self.seed, self.hflip = shuffle, seed, hflip
        self.epoch, self.skip = 0, 0
        self.steps = self._schedule()
        self.sampler = _EpochSetter(self)

    def _schedule(self) -> list[tuple[int, int]]:
        """(seq_len, global batch size) per step, from ``seed`` alone; the sizes sum to ``n``."""
        gen, left, steps = _gen(self.seed, -2), self.n, []
        while left > 0:
            s = self.seq_lens[int(torch.randint(len(self.seq_lens), (1,), generator=gen))]
            b = min(left, self.num_replicas * max(1, self.tokens_per_batch // s))
            steps.append((s, b))
            left -= b
        if len(steps) > 1 and steps[-1][1] < self.num_replicas:  # a rank would get no image: fold it in
            s, b = steps.pop()
            steps[-1] = (steps[-1][0], steps[-1][1] + b)
        return steps

    def plan(self) -> list[list[tuple[int, int, bool]]]:
        """This rank's batches of the current epoch: a pure function of (seed, epoch, rank)."""
        if self.shuffle:
            order = torch.randperm(self.n, generator=_gen(self.seed, self.epoch)).tolist()
            steps = [self.steps[i] for i in torch.randperm(len(self.steps), generator=_gen(self.seed, self.epoch, -3))]
        else:
            order, steps = list(range(self.n)), self.steps
        batches, start = [], 0
        for b, (s, size) in enumerate(steps):
            mine = order[start : start + size][self.rank :: self.num_replicas]
            start += size
            if self.hflip:
                flips = (torch.rand(len(mine), generator=_gen(self.seed, self.epoch, self.rank, b)) < 0.5).tolist()
            else:
                flips = [False] * len(mine)
            batches.append([(i, s, f) for i, f in zip(mine, flips, strict=True)])
        return batches

    def __iter__(self):
        batches, skip = self.plan(), self.skip
        self.skip = 0
        return iter(batches[skip:])

    def __len__(self) -> int:
        return len(self.steps)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class _EpochSetter:
    """Where Lightning looks for ``set_epoch`` on a batch sampler (``batch_sampler.sampler``)."""

    def __init__(self, batch_sampler: TokenBudgetBatchSampler) -> None:
        self.batch_sampler = batch_sampler

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def patchify_batch(x: Tensor, patch_size: int, seq_len: int) -> dict[str, Tensor]:
    """Images of one size (B, C, H, W) float -> the patch dict at their common own-aspect grid of at most
    ``seq_len`` patches, padded to ``seq_len``; equal to ``patchify_image`` per image + ``pad_batch``."""
    B, C, H, W = x.shape
    p = patch_size
    h, w = seq_grid((H, W), (p, p), seq_len)
    if (h * p, w * p) != (H, W):
        x = F.interpolate(x, size=(h * p, w * p), mode="bicubic", align_corners=False, antialias=True)
    patches = x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 3, 5, 1).reshape(B, h * w, p * p * C)  # (B, h*w, p*p*C)
    rows, cols = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
    coord = torch.stack([rows.flatten(), cols.flatten()], dim=1).expand(B, -1, -1)  # (B, h*w, 2)
    pad = seq_len - h * w
    valid = torch.ones(B, h * w, dtype=torch.bool, device=x.device)
    return {"patches": F.pad(patches, (0, 0, 0, pad)), "patch_coord": F.pad(coord, (0, 0, 0, pad)),
            "patch_valid": F.pad(valid, (0, pad), value=False)}  # fmt: skip


def _key(key, seq_len: int) -> tuple[int, int, bool]:
    """A training key (index, seq_len, flip) or an evaluation index (at ``seq_len``, unflipped)."""
    return (int(key[0]), int(key[1]), bool(key[2])) if isinstance(key, (tuple, list)) else (int(key), seq_len, False)


class NaFlexTensorDataset(TensorImageDataset):
    """The fast path: ``__getitems__(keys) -> (uint8 (B, C, H, W), labels, seq_len, flips (B,) bool)``;
    ``NaFlexInput.batch`` then flips, normalises and patchifies the batch on its device."""

    def __init__(self, images: Tensor, labels: Tensor, eval_seq_len: int):
        super().__init__(images, labels)
        self.eval_seq_len = eval_seq_len

    def __getitems__(self, keys):
        keys = [_key(k, self.eval_seq_len) for k in keys]
        idx = torch.tensor([k[0] for k in keys], dtype=torch.long)
        return self.images[idx], self.labels[idx], keys[0][1], torch.tensor([k[2] for k in keys])


class NaFlexImageDataset(Dataset):
    """The standard path: ``base[indices[i]]`` (PIL or uint8 tensor, label) -> (patch dict, label, seq_len),
    one image at a time at its native aspect (workers may run it); ``naflex_collate`` pads the batch."""

    def __init__(self, base: Dataset, indices: Tensor | None, prep: NaFlexInput, eval_seq_len: int):
        self.base, self.indices, self.prep, self.eval_seq_len = base, indices, prep, eval_seq_len

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, key):
        i, seq_len, flip = _key(key, self.eval_seq_len)
        image, label = self.base[i if self.indices is None else int(self.indices[i])]
        x = TF.to_image(image)[None]  # (1, C, H, W) uint8
        x = self.prep.pixels(x, torch.tensor([flip]))[0]
        return patchify_image(x, self.prep.patch_size, seq_len), int(label), seq_len


def naflex_collate(items) -> tuple[dict[str, Tensor], Tensor]:
    """Per-image (patch dict, label, seq_len) -> (batch dict padded to the batch's seq_len, labels (B,))."""
    return pad_batch([it[0] for it in items], items[0][2]), torch.tensor([it[1] for it in items])


@dataclass(frozen=True)
class NaFlexInput:
    """uint8 pixels -> normalised float -> patches, the same ops on both paths."""

    patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    out_chans: int

    def pixels(self, x: Tensor, flip: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float32 (B, out_chans, H, W), flipped where ``flip`` (B,) is True."""
        x = torch.where(flip.to(x.device)[:, None, None, None], x.flip(-1), x)
        x = TF.normalize(TF.to_dtype(x, torch.float32, scale=True), list(self.mean), list(self.std))
        if x.shape[1] != self.out_chans:  # grayscale data, RGB model
            x = x.expand(-1, self.out_chans, -1, -1).contiguous()
        return x

    def batch(self, images: Tensor, labels: Tensor, seq_len: int, flip: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        """A fast-path batch of one image size -> (patch dict padded to ``seq_len``, labels)."""
        return patchify_batch(self.pixels(images, flip), self.patch_size, int(seq_len)), labels

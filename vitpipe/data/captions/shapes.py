"""shapes_captions: a procedural captioning set that needs no download and trains on a CPU.

Each image holds one to three coloured shapes (circle / square / triangle, small / large) in
distinct cells of a 2x2 layout on a black canvas; every shape has its own colour. The
references state size, colour, shape and the relative position of consecutive shapes:

    "a small red circle left of a large blue square above a small green triangle"

Several references per image read the scene in different orders (left to right, top to bottom,
and both reversed), so BLEU/CIDEr-D see genuine multi-reference data. Everything follows from
``seed``: the same seed gives the same pixels and captions on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from vitpipe.data.captions.base import SPLITS, CaptionDataModule
from vitpipe.errors import ConfigError

# saturated colours a few steps apart, so each is one exact RGB value on the canvas
COLORS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 235), "yellow": (235, 215, 40),
          "purple": (160, 60, 200)}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 0.25, "large": 0.4}  # radius as a fraction of the cell side
CELLS = ((0, 0), (0, 1), (1, 0), (1, 1))  # (row, col) of the 2x2 layout


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    size: str
    row: int  # layout cell
    col: int
    cy: float  # centre in pixels
    cx: float
    radius: float

    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.kind}"


def _relation(a: Shape, b: Shape) -> str:
    """Where a stands relative to b; horizontal first, since the cells differ in one axis or both."""
    if a.col != b.col:
        return "left of" if a.col < b.col else "right of"
    return "above" if a.row < b.row else "below"


def _chain(shapes: list[Shape]) -> str:
    words = [shapes[0].phrase()]
    for a, b in zip(shapes, shapes[1:]):
        words += [_relation(a, b), b.phrase()]
    return " ".join(words)


def describe(shapes: list[Shape]) -> list[str]:
    """Reference captions of a scene: read left-to-right, top-to-bottom, and both reversed
    (duplicates removed, order kept: the first is the canonical left-to-right reading)."""
    horizontal = sorted(shapes, key=lambda s: (s.col, s.row))
    vertical = sorted(shapes, key=lambda s: (s.row, s.col))
    caps = [_chain(horizontal), _chain(vertical), _chain(horizontal[::-1]), _chain(vertical[::-1])]
    if len(shapes) == 1:
        caps.append("there is " + caps[0])
    return list(dict.fromkeys(caps))


def sample_scene(rng: np.random.Generator, img_size: int, max_shapes: int) -> list[Shape]:
    n = int(rng.integers(1, max_shapes + 1))
    cell = img_size / 2
    cells = rng.choice(len(CELLS), size=n, replace=False)
    colors = rng.choice(len(COLORS), size=n, replace=False)
    names = list(COLORS)
    shapes = []
    for c, k in zip(cells, colors):
        row, col = CELLS[c]
        size = ("small", "large")[int(rng.integers(2))]
        r = SIZES[size] * cell
        slack = cell / 2 - r - 1  # keep the shape inside its cell, one pixel clear of the border
        cy = row * cell + cell / 2 + rng.uniform(-slack, slack)
        cx = col * cell + cell / 2 + rng.uniform(-slack, slack)
        shapes.append(Shape(SHAPES[int(rng.integers(len(SHAPES)))], names[k], size, row, col, cy, cx, r))
    return shapes


def shape_mask(s: Shape, img_size: int) -> np.ndarray:
    """Bool (H, W): the pixels (sampled at pixel centres) the shape covers."""
    y, x = np.mgrid[0:img_size, 0:img_size] + 0.5
    dy, dx = y - s.cy, x - s.cx
    if s.kind == "circle":
        return dy**2 + dx**2 <= s.radius**2
    if s.kind == "square":
        return (np.abs(dy) <= s.radius * 0.9) & (np.abs(dx) <= s.radius * 0.9)  # about the circle's area
    # triangle, apex up: the half-width grows from 0 at the top to r at the bottom
    return (np.abs(dy) <= s.radius) & (np.abs(dx) <= (dy + s.radius) / 2)


def render(shapes: list[Shape], img_size: int) -> np.ndarray:
    """(H, W, 3) uint8 on black."""
    img = np.zeros((img_size, img_size, 3), dtype=np.uint8)
    for s in shapes:
        img[shape_mask(s, img_size)] = COLORS[s.color]
    return img


def make_split(n: int, *, img_size: int, max_shapes: int, seed: int) -> tuple[np.ndarray, list[list[Shape]]]:
    """n images (n, H, W, 3) uint8 and their scenes, all from ``seed``."""
    rng = np.random.default_rng(seed)
    scenes = [sample_scene(rng, img_size, max_shapes) for _ in range(n)]
    return np.stack([render(s, img_size) for s in scenes]) if n else np.zeros((0, img_size, img_size, 3), np.uint8), scenes


class ShapesCaptionDataModule(CaptionDataModule):
    """Procedural shapes captions. Splits use independent streams of ``seed`` (train, val, test)."""

    def __init__(self, *, num_train: int = 4000, num_val: int = 500, num_test: int = 500, img_size: int = 32,
                 in_chans: int = 3, max_shapes: int = 3, seed: int = 0, **kwargs) -> None:
        super().__init__(seed=seed, **kwargs)
        if in_chans != 3:
            raise ConfigError(f"shapes_captions draws colours and needs in_chans=3, got in_chans={in_chans}")
        if not 1 <= max_shapes <= len(CELLS):
            raise ConfigError(f"max_shapes={max_shapes} must be between 1 and {len(CELLS)} (one shape per layout cell)")
        if img_size < 16:
            raise ConfigError(f"img_size={img_size} is too small to draw shapes; use >= 16 (e.g. 32 or 64)")
        for name, n in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if n < 1:
                raise ConfigError(f"{name}={n} must be >= 1")
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.img_size, self.max_shapes, self.seed = img_size, max_shapes, seed
        self.scenes: dict[str, list[list[Shape]]] = {}

    def _load(self, split: str):
        seeds = np.random.SeedSequence(self.seed).spawn(len(SPLITS))
        pixels, scenes = make_split(self.sizes[split], img_size=self.img_size, max_shapes=self.max_shapes,
                                    seed=seeds[SPLITS.index(split)])
        self.scenes[split] = scenes
        mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)
        images = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255 - mean) / std  # (N, 3, H, W)
        return images.__getitem__, [describe(s) for s in scenes], range(len(scenes))

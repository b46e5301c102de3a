"""The pointing game on a synthetic task: do the relevance maps point at the evidence?

Task: a red 8x8 square sits somewhere in one quadrant of a 32x32 image of RGB noise; the label is
the quadrant. A tiny ViT (patch 8, so a 4x4 grid) trains on CPU for a few hundred steps; the
pointing score of a map is the share of test images whose map maximum falls in the labelled
quadrant (chance: 1/4).

Why red on full-range noise: on a flat dark background the models we trained often solved the task
by attending to the *empty* quadrants (the complement also gives the answer) and rollout,
faithfully, pointed away from the square. A background whose patches all differ makes "attend to
the object" the easy solution, which is what the game is about.

    python -m vitpipe.viz.pointing --seeds 0 1 2 3 4 --registers 0 4

prints the score of attention rollout and gradient rollout per seed and register count (register
tokens: Darcet et al. 2024, "Vision Transformers Need Registers"). ``tests/test_pointing.py`` and
``tests/test_faithfulness.py`` train the seed-0 model of this module.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SIZE, SQUARE, PATCH = 32, 8, 8


def quadrant_images(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(n, 3, 32, 32) noise images with a red square in quadrant y (0 TL, 1 TR, 2 BL, 3 BR)."""
    x = torch.rand(n, 3, SIZE, SIZE, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    half = SIZE // 2
    top = torch.randint(0, half - SQUARE + 1, (n,), generator=gen) + (y // 2) * half
    left = torch.randint(0, half - SQUARE + 1, (n,), generator=gen) + (y % 2) * half
    pos = torch.arange(SIZE)
    rows = (pos >= top[:, None]) & (pos < top[:, None] + SQUARE)  # (n, 32)
    cols = (pos >= left[:, None]) & (pos < left[:, None] + SQUARE)
    square = (rows[:, :, None] & cols[:, None, :])[:, None]  # (n, 1, 32, 32)
    red = torch.tensor([1.0, 0.0, 0.0]).reshape(1, 3, 1, 1)
    return torch.where(square, red, x), y


def quadrant_of_max(maps: Tensor) -> Tensor:
    """(B, h, w) maps -> (B,) quadrant index of each map's maximum."""
    h, w = maps.shape[-2:]
    flat = maps.flatten(1).argmax(1)
    row, col = flat // w, flat % w
    return (row >= h // 2).long() * 2 + (col >= w // 2).long()


def pointing_score(maps: Tensor, y: Tensor) -> float:
    """Share of maps whose maximum lies in the labelled quadrant."""
    return (quadrant_of_max(maps) == y).float().mean().item()


def quadrant_model(reg_tokens: int = 0) -> nn.Module:
    """The task's ViT: vit_micro with 2 blocks on the 4x4 grid, fixed sin-cos positions (a learned
    table from scratch needs many more steps here)."""
    from vitpipe import create_model

    return create_model("vit_micro", img_size=SIZE, patch_size=PATCH, depth=2, num_classes=4,
                        pos_embed="sincos2d", reg_tokens=reg_tokens)  # fmt: skip


@dataclass
class Trained:
    model: nn.Module
    x_test: Tensor
    y_test: Tensor
    accuracy: float
    seconds: float


def train_quadrant_model(seed: int = 0, *, reg_tokens: int = 0, steps: int = 400, n_train: int = 4096,
                         n_test: int = 200) -> Trained:
    """Train the task's model on one CPU thread (tiny matrices: more threads only contend)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        x_train, y_train = quadrant_images(n_train, gen)
        x_test, y_test = quadrant_images(n_test, gen)
        model = quadrant_model(reg_tokens)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
        start = time.perf_counter()
        model.train()
        for _ in range(steps):
            idx = torch.randint(0, len(x_train), (64,), generator=gen)
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(x_test).argmax(-1) == y_test).float().mean().item()
        return Trained(model, x_test, y_test, acc, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


def scores(trained: Trained) -> dict[str, float]:
    """Pointing score of attention rollout and gradient rollout (for the labelled class)."""
    from vitpipe.viz.rollout import gradient_rollout, rollout_for_model

    x, y = trained.x_test, trained.y_test
    return {"rollout": pointing_score(rollout_for_model(trained.model, x), y),
            "gradient": pointing_score(gradient_rollout(trained.model, x, y), y)}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--registers", type=int, nargs="+", default=[0, 4])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    rows = []
    for reg in args.registers:
        for seed in args.seeds:
            trained = train_quadrant_model(seed, reg_tokens=reg, steps=args.steps)
            rows.append({"registers": reg, "seed": seed, "accuracy": trained.accuracy, **scores(trained)})
            print(f"registers {reg}  seed {seed}  accuracy {trained.accuracy:.3f}  "
                  f"rollout {rows[-1]['rollout']:.3f}  gradient {rows[-1]['gradient']:.3f}", flush=True)
    print("\n| registers | accuracy | rollout pointing | gradient rollout pointing |\n|---|---|---|---|")
    for reg in args.registers:
        sel = [r for r in rows if r["registers"] == reg]
        cell = {k: _mean_sd([r[k] for r in sel]) for k in ("accuracy", "rollout", "gradient")}
        print(f"| {reg} | {cell['accuracy']} | {cell['rollout']} | {cell['gradient']} |")
    print(f"(mean +- std over seeds {', '.join(map(str, args.seeds))})")
    return rows


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


if __name__ == "__main__":
    main()

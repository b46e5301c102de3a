"""Interleaved timing: contenders take turns (A B, B A, A B, ...) so the load of a shared,
noisy machine falls on all of them alike; warm-up is dropped; the figure is a median of repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    """Wait for queued kernels, so a host clock reading covers the work (CUDA is asynchronous)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _order(names: list[str], turn: int) -> list[str]:
    return names if turn % 2 == 0 else names[::-1]  # alternate who goes first: drift cancels


def interleave_steps(fns: dict[str, Callable[[], object]], *, steps: int, warmup: int, repeats: int,
                     device: str) -> dict[str, list[list[float]]]:
    """Per-step seconds ``{name: [repeat][step]}``; the contenders alternate step by step.

    Every contender first runs ``warmup`` untimed steps (compilation, allocator growth).
    """
    names = list(fns)
    for turn in range(warmup):
        for name in _order(names, turn):
            fns[name]()
    sync(device)
    times = {name: [[] for _ in range(repeats)] for name in names}
    for r in range(repeats):
        for i in range(steps):
            for name in _order(names, r * steps + i):
                t0 = time.perf_counter()
                fns[name]()
                sync(device)
                times[name][r].append(time.perf_counter() - t0)
    return times


def interleave_runs(runs: dict[str, Callable[[], list[float]]], *, repeats: int) -> dict[str, list[list[float]]]:
    """``{name: [repeat][step]}`` for contenders that time themselves (a whole ``Trainer.fit``, a
    loader run): each call is one repeat returning its steady-state step times, runs alternate."""
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in _order(names, r):
            times[name].append(list(runs[name]()))
    return times


class StepClock:
    """Timestamps at the end of each step; step k's time is the gap since step k-1 ended, so data
    loading and framework work between steps count. Steps 1..warmup are dropped."""

    def __init__(self, *, warmup: int, device: str) -> None:
        self.warmup, self.device, self.stamps = warmup, device, []

    def tick(self) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def times(self) -> list[float]:
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]  # gaps[j] is step j+2
        return gaps[self.warmup - 1 :]


def summarize(times: list[list[float]], batch_size: int) -> dict:
    """Median step time of each repeat, then the median over repeats; images per second from it."""
    per_repeat = [statistics.median(r) for r in times]
    step = statistics.median(per_repeat)
    return {
        "step_s": step,
        "img_s": batch_size / step,
        "per_repeat_step_s": per_repeat,
        "min_step_s": min(min(r) for r in times),
        "timed_steps": sum(len(r) for r in times),
    }


def paired_ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """Median of step-by-step ratios a/b: with interleaved steps each pair saw nearly the same load."""
    return statistics.median(x / y for ra, rb in zip(a, b) for x, y in zip(ra, rb))

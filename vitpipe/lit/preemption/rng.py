"""Every rank's random generators in each checkpoint, given back on resume.

Each checkpoint gets ``RNG_KEY``: the global generators (torch, CUDA, numpy, Python) of every rank,
gathered into the one file rank 0 writes (a collective, as Lightning's saves are). A resumed fit gives
each rank its own back in ``on_train_start``: after everything the resume itself does (loading, setting
up the loaders) and right before the loop's next batch, the point where the saving run stood. Drop path,
dropout and mixup then draw what they would have drawn. A checkpoint without them (older, or another
world size) resumes with fresh streams and says so in one line.
"""

from __future__ import annotations

import torch

from vitpipe.data.resume import RNG_KEY, rank_rng_state, rng_state, set_rng_state


class RandomStreams:
    def __init__(self) -> None:
        self._state: dict | None = None  # this rank's saved generators, from load to restore

    def save(self, trainer, checkpoint: dict) -> None:
        checkpoint[RNG_KEY] = _of_all_ranks(trainer)

    def load(self, trainer, checkpoint: dict) -> str | None:
        """Keep this rank's generators of ``checkpoint`` for ``restore``; why they start fresh instead, or None."""
        self._state, fresh = rank_rng_state(checkpoint.get(RNG_KEY), trainer.global_rank, trainer.world_size)
        return fresh

    def restore(self) -> None:
        if self._state is not None:
            set_rng_state(self._state)
            self._state = None


def _of_all_ranks(trainer) -> list[dict]:
    """Every rank's ``rng_state()``, rank 0 first; a collective under DDP (every rank dumps the
    checkpoint that rank 0 writes, as Lightning's ``save_checkpoint`` requires)."""
    mine = rng_state()
    dist = torch.distributed
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    states: list = [None] * trainer.world_size
    dist.all_gather_object(states, mine)
    return states

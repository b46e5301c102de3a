"""What a checkpoint keeps so that a resumed run goes on exactly as if it had never stopped.

ResumeState: where a run's training data stream stands. Three things come back: ``epoch`` (picks
the sampler's permutation, a function of (seed, epoch)), ``batches_done`` (how far into it this rank
had trained: the next pass skips them, once) and ``step`` (batches trained in the run: with (seed,
rank) it seeds each batch's crops and flips). ``observe`` copies them from Lightning's checkpointed
loop counters, so what is stored is what the loop trained.

The global random streams: what the training step itself draws (timm's DropPath and dropout from
torch's global generator, or CUDA's; timm's Mixup/CutMix from numpy's; Python's ``random``) is
reproduced only if those generators continue where they stood. Lightning's checkpoints hold no
generator state, so ``rng_state`` / ``set_rng_state`` put one process's into plain data (tensors,
ints, lists: a ``weights_only`` load reads them) and ``RNG_KEY`` holds one entry per rank
(vitpipe.lit.preemption.rng.RandomStreams gathers, saves and restores them). Nothing else may
draw from those generators between the save and the next training step, or it must draw the same in
the resumed run: hence every vitpipe DataLoader has its own ``loader_generator`` (an iterator of a
DataLoader without one draws its workers' base seed from torch's global generator, and a resumed
run creates its iterators at other moments than the run it continues).
"""

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states

POSITION_KEY = "batches_done_in_epoch"
RNG_KEY = "rng_states"  # the checkpoint's list of per-rank generator states, rank 0 first
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


def restores_position(datamodule, checkpoint: dict) -> bool:
    """True when ``checkpoint`` holds ``datamodule``'s ResumeState (Lightning keeps a data module's
    ``state_dict`` under its class name): a fit resumed from it continues mid-epoch exactly."""
    state = checkpoint.get(type(datamodule).__qualname__) if datamodule is not None else None
    return isinstance(getattr(datamodule, "resume", None), ResumeState) and isinstance(state, dict) \
        and POSITION_KEY in state


class ResumeState:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.epoch = 0
        self.batches_done = 0  # of this epoch, on this rank
        self.step = 0  # batches trained in the run before the current one
        self._pending = 0  # restored batches_done not yet applied to a sampler

    def observe(self, trainer) -> bool:
        """Copy the fit loop's counters; False (nothing changed) without a fit loop."""
        loop = getattr(trainer, "fit_loop", None)
        if loop is None:
            return False
        progress = loop.epoch_loop.batch_progress
        # `processed`, not `completed`: a save from on_train_batch_end (every N steps) runs after the
        # batch was trained but before Lightning marks it completed; counting completed would make
        # the resumed epoch train that batch twice
        done = progress.current.processed
        self.epoch = trainer.current_epoch
        # a finished epoch resumes at the start of the next one, not past its end
        self.batches_done = int(done) if done < trainer.num_training_batches else 0
        self.step = int(progress.total.ready)
        return True

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, POSITION_KEY: self.batches_done, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state.get("epoch", 0))
        self.batches_done = self._pending = int(state.get(POSITION_KEY, 0))
        self.step = int(state.get("step", 0))

    def take_offset(self, batch_size: int) -> int:
        """Samples of this rank's shard the next training pass skips: the restored position, once."""
        offset, self._pending = self._pending * batch_size, 0
        return offset

    def generator(self, device, rank: int) -> torch.Generator:
        """The current batch's augmentation generator: a function of (seed, rank, step) only."""
        gen = torch.Generator(device=device)
        gen.manual_seed(hash((self.seed, rank, self.step)) & _SEED_MASK)
        return gen

    def loader_generator(self, rank: int) -> torch.Generator:
        """The training loader's own generator: a function of (seed, rank, epoch the loader is built in)."""
        return loader_generator(self.seed, rank, self.epoch)


def loader_generator(seed: int, rank: int, epoch: int = 0) -> torch.Generator:
    """A DataLoader's own generator, so that making its iterator draws nothing from torch's global one.

    A DataLoader draws one number per iterator (its workers' base seed) from ``generator``, or from
    the global generator without one. A resumed run makes its first iterator before its generators
    are restored and none at the epoch boundary it resumes from, so a draw there would shift every
    later drop-path mask against the run it continues.
    """
    return torch.Generator().manual_seed(hash((seed, rank, epoch, -1)) & _SEED_MASK)  # -1: not a step's


def rng_state() -> dict:
    """This process's global generators (torch, CUDA per device when present, numpy, Python ``random``)
    as plain data: tensors, ints, floats and lists, which a ``weights_only`` torch.load reads."""
    s = _collect_rng_states(include_cuda=True)
    name, keys, pos, has_gauss, cached_gaussian = s["numpy"]
    version, internal, gauss_next = s["python"]
    return {"torch": s["torch"], "torch.cuda": list(s["torch.cuda"]),
            "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian)],
            "python": [int(version), list(internal), gauss_next]}  # fmt: skip


def set_rng_state(state: dict) -> None:
    """Continue every global generator from ``state`` (one entry of ``RNG_KEY``, as ``rng_state`` made it)."""
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    _set_rng_states({"torch": state["torch"], "torch.cuda": state["torch.cuda"], "python": state["python"],
                     "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian)})  # fmt: skip


def rank_rng_state(saved, rank: int, world_size: int) -> tuple[dict | None, str | None]:
    """This rank's entry of a checkpoint's ``RNG_KEY``, or None and why the random streams start fresh."""
    if not isinstance(saved, list) or not saved:
        return None, "the checkpoint holds no random-generator state"
    if len(saved) != world_size:
        return None, (f"the checkpoint holds the random generators of {len(saved)} process(es), "
                      f"this run has {world_size}")
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved[rank]["torch.cuda"]) != cuda:
        return None, (f"the checkpoint holds the CUDA generators of {len(saved[rank]['torch.cuda'])} device(s), "
                      f"this process sees {cuda}")
    return saved[rank], None

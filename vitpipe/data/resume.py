"""ResumeState: where a run's training data stream stands, the data state a checkpoint keeps.

A run killed mid-epoch goes on exactly as if it had never stopped when three things come back:
``epoch`` (picks the sampler's permutation, a function of (seed, epoch)), ``batches_done`` (how
far into it this rank had trained: the next pass skips them, once) and ``step`` (batches trained
in the run: with (seed, rank) it seeds each batch's crops and flips). ``observe`` copies them from
Lightning's checkpointed loop counters, so what is stored is what the loop trained.
"""

import torch

POSITION_KEY = "batches_done_in_epoch"


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
        gen.manual_seed(hash((self.seed, rank, self.step)) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

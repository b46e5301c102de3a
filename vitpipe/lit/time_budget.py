"""A training run measured in wall-clock time: ``trainer.time_budget`` and the expected duration.

``trainer.time_budget=30min`` makes the whole run (training, its validations and the final test) end
within 30 minutes on whatever machine runs it. Lightning's ``max_time`` only stops training, which
cuts a cosine schedule short; here the schedule is *fitted* to the time instead (as Ultralytics'
``time=`` does for detection):

1. the optimizer step is timed over a few steps after warm-up (the first steps of a process pay for
   allocation, lazy initialisation and any compile): ``WARM_STEPS`` skipped, ``MEASURE_STEPS`` timed;
2. the number of optimizer steps that fit the remaining time is computed, validation (every epoch) and
   the final test included, less a small reserve for the run's last files (``_finish_reserve``);
3. the learning-rate schedule runs over a *progress* in [0, 1] instead of a step count: the module's
   timm scheduler is built over ``RESOLUTION`` units and stepped with ``position(step)`` (warm-up
   and cosine, or a linear decay, keep their shapes over whatever number of steps fits);
4. every twentieth of the plan (``REFITS``; at fixed steps, the same on every rank), and whenever a
   twentieth of the budget has passed since the last fit (a pace that collapses stretches those steps),
   the plan is fitted again to the pace since the last fit and the validations timed so far. A new plan starts from the
   progress already reached, so the learning rate is continuous: only its remaining slope changes;
5. at the planned step the run stops (``trainer.should_stop``: Lightning validates, checkpoints, and the
   test follows) with the schedule at its end (progress 1: the scheduler's final learning rate).

With or without a budget, a run that reaches ``trainer.max_steps`` inside an epoch stops the same way, so
its last steps are validated before the test picks the best checkpoint (Lightning itself stops there
without a validation).

The elapsed time and the plan are this callback's state in every checkpoint, so a run resumed after a
SIGTERM or a SLURM requeue continues the same budget (the time between the kill and the resume is not
the run's). Under DDP every rank measures, and rank 0's plan is broadcast at the same steps on all
ranks, so all ranks stop at the same step.

Without a budget the same measurement gives every run its expected duration after its first steps.
"""

from __future__ import annotations

import math
import time

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from vitpipe.config.duration import format_duration
from vitpipe.run.wallclock import exit_reserve, run_began, run_ended

WARM_STEPS = 3  # optimizer steps of a process not timed (allocation, lazy init, compile)
MEASURE_STEPS = 10  # optimizer steps timed for the first plan (a fixed count: every DDP rank plans at the same step)
RESOLUTION = 1_000_000  # the budget's scheduler length, in progress units (``position`` maps steps onto it)
REFITS = 20  # plan refits over a run: every (planned steps / REFITS) optimizer steps
FORWARD_SHARE = 1 / 3  # a forward pass's share of a training step's time: the guess for a validation not yet timed

class RunClock:
    """Wall time of a run across processes: ``carried`` (what earlier processes spent, from the
    checkpoint) plus the time since this process began the run (``vitpipe.run.wallclock``: from the
    process's start for a typed command, so Python and Hydra starting up count too)."""

    def __init__(self) -> None:
        self.start = run_began()
        self.carried = 0.0

    def elapsed(self) -> float:
        return self.carried + time.monotonic() - self.start

    def stop(self) -> None:
        """The run is over: the next run of this process (a multirun's next job) counts from now."""
        run_ended()


class TrainingClock(L.Callback):
    """Times the optimizer step; prints the expected duration; with ``budget_s``, fits the run to it.

    ``clock`` is the run's ``RunClock`` (started before the data loads: the budget is the whole run's);
    ``tests``: whether the run tests after the fit (``test=false``: no test to keep time for).
    The module's ``lr_scheduler_step`` reads ``position(step)`` from the callback that ``budget_of``
    finds on its trainer; its ``configure_optimizers`` builds the scheduler over ``RESOLUTION``.
    """

    def __init__(self, budget_s: float | None = None, clock: RunClock | None = None, *, tests: bool = True) -> None:
        self.budget_s = budget_s
        self.clock = clock or RunClock()
        self.tests = tests
        # the plan: progress p0 at step s0, progress 1 at step total (None: not planned yet)
        self.total: int | None = None
        self.s0, self.p0 = 0, 0.0
        self.step_s: float | None = None  # a training step's measured time
        self.val_s: float | None = None  # one validation's measured time (None: not timed yet)
        self.val_share: float | None = None  # val_s per validation sample, for the test's estimate
        self.fits = 0
        self.every: int | None = None  # optimizer steps between refits (None: until the first plan)
        self._marks: dict[int, float] = {}  # optimizer step -> time, this process
        self._first_step: int | None = None
        self._last_fit: int | None = None
        self._val_start: float | None = None
        self._val_total = 0.0
        self._sizes: dict[str, tuple[int, int, int]] = {}
        self._loaded: dict | None = None
        self._announced = False

    # the schedule ---------------------------------------------------------------------------------
    def progress(self, step: int) -> float:
        """The schedule's progress at optimizer step ``step``, in [0, 1]."""
        if self.total is None:
            return self.p0
        span = max(1, self.total - self.s0)
        return min(1.0, max(0.0, self.p0 + (step - self.s0) * (1.0 - self.p0) / span))

    def position(self, step: int) -> float:
        return self.progress(step) * RESOLUTION

    def _refit(self, trainer, step: int, total: int) -> None:
        self.p0, self.s0 = self.progress(step), step
        self.total = max(total, step)
        self.fits += 1
        if self.every is None:  # from the first plan, so that every rank refits at the same steps
            self.every = max(MEASURE_STEPS, (self.total - step) // REFITS)

    # hooks -----------------------------------------------------------------------------------------
    def _train_time(self) -> float:
        """This process's wall time less its validations: the clock steps are timed on."""
        return time.monotonic() - self._val_total

    def on_train_start(self, trainer, pl_module) -> None:
        if self._loaded is not None:
            self._resume(self._loaded)
            self._loaded = None
        self._val_total = 0.0
        self._first_step = trainer.global_step
        self._marks = {trainer.global_step: self._train_time()}
        self._last_fit = None  # a resumed run times its steps afresh before it refits
        if self.budget_s is not None and trainer.global_step and self.total is not None:
            _say(f"vitpipe: time budget {format_duration(self.budget_s)}: {format_duration(self.clock.elapsed())} "
                 f"spent before this resume; the plan continues at step {trainer.global_step} of {self.total}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self._marks:
            return  # an accumulation micro-batch: no optimizer step yet
        self._marks[step] = self._train_time()
        if step - self._first_step == WARM_STEPS + MEASURE_STEPS and self.step_s is None:
            taken = self._marks[step] - self._marks[self._first_step + WARM_STEPS]
            self.step_s = self._agree(trainer, taken / MEASURE_STEPS)
            self._last_fit = step
            self._plan(trainer, step, first=True)
        elif (self.budget_s is not None and self.every and self._last_fit is not None and not trainer.should_stop
              and (step - self._last_fit >= self.every or self._time_due(trainer, step))):
            pace = (self._marks[step] - self._marks[self._last_fit]) / (step - self._last_fit)
            self.step_s = self._agree(trainer, pace)
            self._last_fit = step
            self._plan(trainer, step, first=False)
        if trainer.max_steps is not None and 0 < trainer.max_steps <= step:
            # Lightning ends a fit at max_steps without validating when that step is inside an epoch: the
            # schedule's end would never be checkpointed as the best, and the test would take the last
            # epoch's weights. A stop request makes it validate (and checkpoint) there first.
            trainer.should_stop = True
        if self.budget_s is None or self.total is None:
            return
        if step >= self.total:
            trainer.should_stop = True
        elif trainer.world_size == 1 and self.step_s is not None and self._out_of_time(trainer):
            # the pace collapsed between two refits (one process only: a stop on time could split DDP
            # ranks); the schedule stops short of its end
            _say(f"vitpipe: time budget: stopping at step {step} of {self.total}: only the final validation "
                 "and test still fit (the pace fell far behind the plan)")
            trainer.should_stop = True

    def _time_due(self, trainer, step: int) -> bool:
        """A refit due on time: a twentieth of the budget gone since the last fit. A pace that collapses (the
        machine taken by other work) stretches the steps between fixed-step refits; this keeps refitting every
        ``budget / REFITS`` seconds instead, so the schedule still reaches its end. Checked every
        ``MEASURE_STEPS`` steps since the last fit, on rank 0's clock (one broadcast then)."""
        since = step - self._last_fit
        if since < MEASURE_STEPS or since % MEASURE_STEPS:
            return False
        late = self._marks[step] - self._marks[self._last_fit] >= self.budget_s / REFITS
        return bool(self._agree_int(trainer, int(late)))

    def _out_of_time(self, trainer) -> bool:
        ending = self._val_estimate(trainer) + self._test_estimate(trainer) + self._finish_reserve() / 2
        return self.clock.elapsed() + ending > self.budget_s

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self._val_start is None:
            return
        took = time.monotonic() - self._val_start
        self._val_start = None
        self._val_total += took
        self.val_s = self._agree(trainer, took)
        samples = _loader_size(trainer, "val")[1]
        if samples:
            self.val_share = self.val_s / samples

    # the plan ------------------------------------------------------------------------------------
    def _plan(self, trainer, step: int, *, first: bool) -> None:
        per_epoch = _steps_per_epoch(trainer)
        val_s = self._val_estimate(trainer)
        val_every = (trainer.check_val_every_n_epoch or 1) if _validates(trainer) else 0
        test_s = self._test_estimate(trainer)
        if self.budget_s is None:
            if first and trainer.is_global_zero:
                self._announce_expected(trainer, step, per_epoch, val_s, val_every, test_s)
            return
        left = self.budget_s - self.clock.elapsed() - test_s - self._finish_reserve() - (val_s if val_every else 0)
        fit = _steps_that_fit(left, self.step_s, per_epoch, val_s if val_every else 0.0, val_every, step)
        cap, capped_by = _step_cap(trainer, per_epoch)
        capped = cap is not None and step + fit > cap
        total = self._agree_int(trainer, cap if capped else step + fit)
        was = self.total
        self._refit(trainer, step, total)
        if trainer.is_global_zero and (first or not self._announced):
            self._announced = True
            _say(f"vitpipe: time budget {format_duration(self.budget_s)}: {self.step_s:.3f} s a step "
                 f"(steps {step - MEASURE_STEPS}-{step}), validation ~{format_duration(val_s)}, "
                 f"test ~{format_duration(test_s)}: {self.total} steps = {self.total / per_epoch:.1f} epochs "
                 f"of {per_epoch}; the learning-rate schedule is fitted to them"
                 + (f" (capped by {capped_by}; -1 lets the budget decide)" if capped else ""))
        elif trainer.is_global_zero and was is not None and abs(self.total - was) > max(1, 0.05 * was):
            _say(f"vitpipe: time budget: the pace is now {self.step_s:.3f} s a step; plan {was} -> {self.total} steps "
                 f"({self.total / per_epoch:.1f} epochs), the schedule continues from progress {self.p0:.3f}")
        if self.total <= step:
            if first and trainer.is_global_zero:
                _say(f"vitpipe: time budget {format_duration(self.budget_s)}: {format_duration(self.clock.elapsed())} "
                     f"went to starting the run and timing its first {step} steps ({self.step_s:.3f} s each); "
                     "no more steps fit: give the run a larger trainer.time_budget")
            trainer.should_stop = True

    def _finish_reserve(self) -> float:
        """Seconds kept for the run's last files (checkpoint load, report, metrics): 1% of the budget + 0.5 s, and
        for a typed command its interpreter's exit (``vitpipe.run.wallclock.exit_reserve``)."""
        return 0.01 * self.budget_s + 0.5 + exit_reserve()

    def _val_estimate(self, trainer) -> float:
        if not _validates(trainer):
            return 0.0
        if self.val_s is not None:
            return self.val_s
        samples = _loader_size(trainer, "val")[1]
        train_batch = max(1, _batch_size(trainer, "train"))
        return FORWARD_SHARE * self.step_s * samples / train_batch if samples else 0.0

    def _test_estimate(self, trainer) -> float:
        if not self.tests:
            return 0.0
        samples = _loader_size(trainer, "test")[1] or _loader_size(trainer, "val")[1]  # no test split: as val
        if self.val_share is not None:
            return self.val_share * samples
        return FORWARD_SHARE * self.step_s * samples / max(1, _batch_size(trainer, "train"))

    def _announce_expected(self, trainer, step, per_epoch, val_s, val_every, test_s) -> None:
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            _say(f"vitpipe: {self.step_s:.3f} s a training step (steps {step - MEASURE_STEPS}-{step})")
            return
        left = max(0, int(total) - step)
        epochs_left = math.ceil(left / per_epoch) if per_epoch else 0
        vals = epochs_left // val_every if val_every else 0
        expected = left * self.step_s + vals * val_s + test_s
        _say(f"vitpipe: {self.step_s:.3f} s a training step (steps {step - MEASURE_STEPS}-{step}); {left} steps "
             f"and {vals} validations to go: expect about {format_duration(expected)} more, test included "
             f"(trainer.time_budget=<duration> fits a run to a time instead)")

    # DDP: one plan ---------------------------------------------------------------------------------
    @staticmethod
    def _agree(trainer, value: float) -> float:
        return float(trainer.strategy.broadcast(value, src=0)) if trainer.world_size > 1 else value

    @staticmethod
    def _agree_int(trainer, value: int) -> int:
        return int(trainer.strategy.broadcast(int(value), src=0)) if trainer.world_size > 1 else int(value)

    # the checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"elapsed_s": self.clock.elapsed(), "budget_s": self.budget_s, "total": self.total, "s0": self.s0,
                "p0": self.p0, "every": self.every, "step_s": self.step_s, "val_s": self.val_s, "val_share": self.val_share,
                "fits": self.fits}

    def load_state_dict(self, state: dict) -> None:
        """Lightning restores callbacks for ``test(ckpt_path=...)`` too: the state is kept here and
        taken up when training starts (``on_train_start``), so testing the best checkpoint does not
        rewind the clock."""
        self._loaded = state

    def _resume(self, state: dict) -> None:
        self.clock.carried += float(state.get("elapsed_s", 0.0))
        if self.budget_s is None or state.get("budget_s") is None:
            return  # a budget added or dropped on resume: this process plans afresh (or not at all)
        if state.get("budget_s") != self.budget_s:
            _say(f"vitpipe: time budget {format_duration(state['budget_s'])} in the checkpoint, "
                 f"{format_duration(self.budget_s)} now: the plan is fitted to the new budget")
        self.total, self.s0, self.p0 = state.get("total"), int(state.get("s0", 0)), float(state.get("p0", 0.0))
        self.every = state.get("every")
        self.val_s, self.val_share, self.fits = state.get("val_s"), state.get("val_share"), int(state.get("fits", 0))
        self._announced = True  # the resume line says where the plan stands

    # the outcome ------------------------------------------------------------------------------------
    def outcome(self) -> dict[str, float]:
        """Metrics for metrics.json: the run's elapsed time across resumes, and the budget if any."""
        out = {"time/run_s": round(self.clock.elapsed(), 2)}
        if self.budget_s is not None:
            out["time/budget_s"] = self.budget_s
            if self.total is not None:
                out["time/planned_steps"] = float(self.total)
        return out

    def announce_outcome(self, trainer) -> None:
        if self.budget_s is None or not trainer.is_global_zero:
            return
        used = self.clock.elapsed()
        _say(f"vitpipe: time budget {format_duration(self.budget_s)}: used {format_duration(used)} "
             f"({100 * used / self.budget_s:.0f}%), {trainer.global_step} steps, final learning-rate progress "
             f"{self.progress(trainer.global_step):.3f}")


def budget_of(trainer) -> TrainingClock | None:
    """The trainer's ``TrainingClock`` that holds a time budget, or None."""
    for cb in getattr(trainer, "callbacks", None) or []:
        if isinstance(cb, TrainingClock) and cb.budget_s is not None:
            return cb
    return None


def _step_cap(trainer, per_epoch: int) -> tuple[int | None, str]:
    """The step bound ``trainer.max_steps`` / ``trainer.max_epochs`` set (-1 or null: none): under a
    budget they stay what Lightning makes them, upper bounds, and the schedule fits the smaller."""
    caps = []
    if trainer.max_steps is not None and trainer.max_steps > 0:
        caps.append((int(trainer.max_steps), f"trainer.max_steps={trainer.max_steps}"))
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        caps.append((int(trainer.max_epochs) * per_epoch, f"trainer.max_epochs={trainer.max_epochs}"))
    return min(caps) if caps else (None, "")


def _steps_that_fit(seconds: float, step_s: float, per_epoch: int, val_s: float, val_every: int, step: int) -> int:
    """The most optimizer steps after ``step`` whose training and full-epoch validations fit ``seconds``."""
    if seconds <= 0 or step_s <= 0:
        return 0

    def cost(n: int) -> float:
        vals = ((step + n) // per_epoch - step // per_epoch) // val_every if val_every and per_epoch else 0
        return n * step_s + vals * val_s

    lo, hi = 0, int(seconds / step_s) + 1
    while lo < hi:  # the largest n with cost(n) <= seconds (cost is monotone in n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds else (lo, mid - 1)
    return lo


def _validates(trainer) -> bool:
    limit = trainer.limit_val_batches
    return bool(trainer.enable_validation) and limit != 0 and limit != 0.0


def _steps_per_epoch(trainer) -> int:
    batches = trainer.num_training_batches
    if not math.isfinite(batches):
        return 10**9
    return max(1, math.ceil(int(batches) / max(1, trainer.accumulate_grad_batches)))


def _loader(trainer, split: str):
    dm = getattr(trainer, "datamodule", None)
    make = getattr(dm, f"{split}_dataloader", None) if dm is not None else None
    if make is None:
        return None
    try:
        return make()
    except Exception:  # noqa: BLE001 - no such split, or not set up: the estimate goes without it
        if split != "test":
            return None
    # During the fit Lightning has set up the train and validation splits only; the test split is set up here,
    # so that the test is estimated from its own images (Fashion-MNIST: 10,000, the validation 5,000). The data
    # module keeps it for the test (``setup`` loads a split once): its loading only moves earlier in the budget.
    try:
        dm.setup("test")
        return make()
    except Exception:  # noqa: BLE001 - a data module without a test split: estimated as its validation
        return None


def _batch_size(trainer, split: str) -> int:
    return _loader_size(trainer, split)[2]


def _loader_size(trainer, split: str) -> tuple[int, int, int]:
    """(batches, samples, batch size) of a split's loader on this rank, as far as it knows them (zeros if
    not); asked of the data module once per split and remembered."""
    clock = budget_of(trainer) or next((c for c in trainer.callbacks if isinstance(c, TrainingClock)), None)
    cache = clock._sizes if clock is not None else {}
    if split not in cache:
        loader = _loader(trainer, split)
        try:
            batches = len(loader) if loader is not None else 0
        except TypeError:
            batches = 0
        size = int(getattr(loader, "batch_size", None) or 1) if loader is not None else 1
        limit = {"val": trainer.limit_val_batches, "test": trainer.limit_test_batches}.get(split)
        if isinstance(limit, int) and not isinstance(limit, bool):
            batches = min(batches, limit)
        elif isinstance(limit, float):
            batches = int(batches * limit)
        cache[split] = (batches, batches * size, size)  # per rank: the loaders shard over ranks themselves
    return cache[split]


@rank_zero_only
def _say(line: str) -> None:
    print(line, flush=True)

"""Run directories: one per run, claimed atomically, and marked while their process lives.

Hydra names a run ``logs/<task>/runs/<date>_<time>`` (a sweep ``logs/<task>/multiruns/<date>_<time>``).
Two runs started in the same second would share that folder (one overwriting the other's
checkpoints, CSV rows interleaved), so the name goes through ``${unique_dir:...}``: the directory
is created with ``os.mkdir`` (atomic: exactly one process succeeds), and a process that finds it
taken tries ``<name>_1``, ``<name>_2``, ... The resolver is cached in the config (as Hydra's
``now``), and Hydra copies that cache into each sweep job's config, so every job of a sweep, also
a SLURM job resolving its config in another process, sees the one directory the sweep claimed.

``${cwd:}`` is the working directory the command was started in. ``${hydra:runtime.cwd}`` means
the same but is unset while Hydra resolves ``hydra.sweep.dir``, so a multirun could not use it.

A training run holds an advisory lock on ``<run dir>/.running`` for as long as its process lives
(released by the kernel on any exit, ``kill -9`` included; ``live(run_dir)``): ``is_live(run_dir)`` lets
``ckpt_path=last`` pass over a run that is still being written.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from omegaconf import OmegaConf

CHECKPOINTS = "checkpoints"  # <run>/checkpoints/: ModelCheckpoint's dirpath in conf/callbacks/default.yaml

LIVE_FILE = ".running"
_held: dict[str, int] = {}  # lock file -> its open fd, while this process holds it


def unique_dir(base: str) -> str:
    """Create and return ``base``, or ``base_1``, ``base_2``, ... when it exists (atomically).

    Under an external multi-process launcher (torchrun; SLURM with several tasks) every rank resolves
    its own config: there the ranks must agree on one name, so ``base`` is returned as it is (give
    such jobs ``hydra.run.dir`` when they may start in different seconds).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return base
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        candidate = base if n == 0 else f"{base}_{n}"
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name next to {base}")


@contextlib.contextmanager
def live(run_dir):
    """Hold the ``.running`` lock of ``run_dir`` while the block runs (a DDP rank that finds it held by
    another rank of the same run goes on without it)."""
    path = Path(run_dir) / LIVE_FILE
    if str(path) in _held:  # nested: the outer block holds it
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        yield
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[str(path)] = fd
    try:
        yield
    finally:
        del _held[str(path)]
        os.close(fd)  # releases the lock; the empty marker file stays (is_live reads the lock, not the file)


def is_live(run_dir) -> bool:
    """True while a process holds ``run_dir``'s ``.running`` lock (False once it exited, however)."""
    path = Path(run_dir) / LIVE_FILE
    if str(path) in _held:
        return False  # this process itself: e.g. an eval inside the run that wrote it
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("cwd"):
        OmegaConf.register_new_resolver("cwd", os.getcwd, use_cache=True)
    if not OmegaConf.has_resolver("unique_dir"):
        OmegaConf.register_new_resolver("unique_dir", unique_dir, use_cache=True)

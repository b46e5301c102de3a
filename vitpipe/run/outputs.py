"""Where a command writes: never over what it reads, and only where it can write.

Every command with an output (``out=`` of export, predict, visualize, make_shards; the run directory of
eval, export, predict, visualize, serve, demo) checks it here before the work starts (rsync and git refuse
a destination inside the source the same way):

- ``check_not_input(out, inputs, key=..., folder=...)``: an output folder may not be, contain or lie
  inside an input (the run a checkpoint belongs to, an image folder, a data root); an output file may
  not be an input file, contain an input, or replace a file inside an input folder (a new file there,
  e.g. ``predict out=<run>/preds.csv``, replaces nothing and is allowed). Paths are compared after
  following links (``realpath``), and an existing output is also compared by inode (a hard link or a
  bind mount of an input is that input). ConfigError in one line naming the value, the input and what
  to pass instead.
- ``check_writable(out, key=..., folder=...)``: each name at most as long as the file system allows, no
  file where a folder has to be, and a probe file written in the folder the output goes to (the real
  test: root ignores mode bits, a read-only mount refuses root too, a full disk refuses the probe's
  bytes). ConfigError in one line otherwise.
- ``checkpoint_inputs(path)``: what reading a checkpoint reads: the file, and its run directory when the
  file sits in one (``<run>/checkpoints/x.ckpt``); ``named_checkpoint_inputs(ckpt_path)`` the same from
  the value as typed, before it is resolved; ``data_inputs(data_cfg)`` a data config's root.
- ``prepare_output(out, inputs, ...)``: the two checks, then what our killed writers left there removed:
  the one call each command makes for its output before its work starts.
"""

from __future__ import annotations

import errno
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vitpipe.errors import ConfigError
from vitpipe.run.dirs import CHECKPOINTS
from vitpipe.run.files import remove_stale_temp_files, remove_stale_temps_below

NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits, where the file system does not say


@dataclass(frozen=True)
class Input:
    """A path a command reads, and how the one-line refusal names it (e.g. ``the run ckpt_path=x reads``)."""

    path: Path
    what: str
    inside_ok: bool = False  # a folder of many runs, a download cache: only being or containing it overlaps


def _real(path) -> Path:
    return Path(os.path.realpath(Path(str(path)).expanduser()))


def _within(inner: Path, outer: Path) -> bool:
    return inner != outer and inner.is_relative_to(outer)


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def overlap(out, inp, *, folder: bool, inside_ok: bool = False) -> str | None:
    """How output ``out`` meets input ``inp`` (``is``, ``contains``, ``lies inside``, ``would replace``), or None."""
    o, i = _real(out), _real(inp)
    if _same(o, i):
        return "is"
    if _within(i, o):
        return "contains"
    if _within(o, i) and i.is_dir() and not inside_ok:
        if folder:
            return "lies inside"
        if o.exists() or o.is_symlink():
            return f"would replace {o.relative_to(i)} in"
    return None


def check_not_input(out, inputs, *, key: str = "out", folder: bool) -> None:
    """ConfigError when output ``out`` (a folder when ``folder``, else one file) overlaps one of ``inputs``."""
    for inp in inputs:
        rel = overlap(out, inp.path, folder=folder, inside_ok=inp.inside_ok)
        if rel is not None:
            raise ConfigError(f"{key}={out} {rel} {inp.what} ({_real(inp.path)}); an output may not replace or "
                              f"remove what the command reads: choose another {key}=")


def checkpoint_inputs(path, ckpt_path=None) -> list[Input]:
    """The checkpoint file ``path`` and, when it sits in ``<run>/checkpoints/``, that run directory."""
    path = Path(path)
    named = f"ckpt_path={ckpt_path}" if ckpt_path is not None else "ckpt_path"
    run = [Input(path.parent.parent, f"the run {named} reads")] if path.parent.name == CHECKPOINTS else []
    return [*run, Input(path, f"the checkpoint {named} reads")]


def named_checkpoint_inputs(ckpt_path) -> list[Input]:
    """What ``ckpt_path=`` as typed names, without resolving it (nothing read, nothing printed): a file and
    its run; a run directory; a folder of runs (``logs/train``: only being or containing it overlaps).
    Empty for ``last``, ``auto``, an unset or a missing path (the task checks the checkpoint it resolves)."""
    if ckpt_path is None or str(ckpt_path) in ("", "last", "auto", "???"):
        return []
    path = Path(str(ckpt_path)).expanduser()
    if path.is_file():
        return checkpoint_inputs(path, ckpt_path)
    if not path.is_dir():
        return []
    if (path / CHECKPOINTS).is_dir() or any(path.glob("*.ckpt")):
        run = path.parent if path.name == CHECKPOINTS else path
        return [Input(run, f"the run ckpt_path={ckpt_path} reads")]
    return [Input(path, f"the runs under ckpt_path={ckpt_path}", inside_ok=True)]


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
        return True
    except OSError:  # absent, or a name too long to look up
        return False


def _nearest_existing(path: Path) -> Path:
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def name_too_long(path) -> tuple[str, int] | None:
    """(the first name in ``path`` longer than its file system allows, that limit), or None; the whole path
    longer than PATH_MAX reads as ("", limit)."""
    full = Path(str(path)).expanduser().absolute()
    base = _nearest_existing(full)
    name_max, path_max = _limit(base, "PC_NAME_MAX", NAME_MAX), _limit(base, "PC_PATH_MAX", PATH_MAX)
    for part in full.parts[1:]:
        if len(os.fsencode(part)) > name_max:
            return part, name_max
    if len(os.fsencode(str(full))) >= path_max:
        return "", path_max
    return None


def _probe(folder: Path) -> None:
    """Write (and sync) a few bytes to an unnamed temporary file in ``folder``: OSError where that fails."""
    with tempfile.TemporaryFile(dir=folder) as f:  # O_TMPFILE where it exists: never visible in the folder
        f.write(b"\0" * 4096)
        f.flush()
        os.fsync(f.fileno())


def check_writable(out, *, key: str = "out", folder: bool, fix: str | None = None) -> None:
    """ConfigError (one line) unless output ``out`` can be created: a folder (``folder``) or a file, written
    beside it first (temp + rename) and, for a folder, inside it. Nothing is created."""
    p = Path(str(out)).expanduser()
    fix = fix or f"pass {key}=<a path in a folder you can write to>"
    long = name_too_long(p)
    if long is not None:
        name, limit = long
        if name:
            raise ConfigError(f"{key}={out}: the name {name[:24]}... is {len(os.fsencode(name))} bytes, longer than "
                              f"the {limit} a file name may have there; pass {key}=<a path with shorter names>")
        raise ConfigError(f"{key}={out}: the path is longer than the {limit} bytes the system allows; "
                          f"pass a shorter {key}=")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{key}={out} is a file, not a folder; pass {key}=<a folder path>")
    if not folder and p.is_dir():
        raise ConfigError(f"{key}={out} is a folder; this output is one file: pass {key}=<a file path>")
    where = _nearest_existing(p.parent.absolute())
    if not where.is_dir():
        raise ConfigError(f"{key}={out}: {where} is a file, not a folder; {fix}")
    places = [where] + ([p] if folder and p.is_dir() else [])
    for place in places:
        try:
            _probe(place)
        except OSError as e:
            why = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise ConfigError(f"{key}={out}: cannot write in {place} ({why}); {fix}") from None


# the data sets whose root is the data itself (a new folder inside it would be read as data: a class
# folder, images under a labels=none root); the others' root is a download cache shared by several
_ROOT_IS_DATA = ("ImageFolderDataModule", "ShardsDataModule")


def data_inputs(data_cfg) -> list[Input]:
    """The root a data config reads (``data.root``), when it is a local path; empty otherwise."""
    if data_cfg is None:
        return []
    from omegaconf import OmegaConf

    try:
        root = OmegaConf.select(data_cfg, "root", default=None, throw_on_missing=False)
        target = str(OmegaConf.select(data_cfg, "_target_", default="") or "")
    except Exception:  # noqa: BLE001 - a root that needs the run to resolve: the data module checks it
        return []
    if root in (None, "") or "://" in str(root):
        return []
    return [Input(Path(str(root)), f"the data data.root={root} reads", inside_ok=not target.endswith(_ROOT_IS_DATA))]


def prepare_output(out, inputs, *, key: str = "out", folder: bool) -> Path:
    """``check_not_input``, then ``check_writable``, then the temporary files killed writers left for ``out``
    (beside it, and inside a folder ``out``) removed; returns ``out`` as a Path. Nothing else is written."""
    out = Path(str(out)).expanduser()
    check_not_input(out, inputs, key=key, folder=folder)
    check_writable(out, key=key, folder=folder)
    if out.parent.is_dir():
        remove_stale_temp_files(out.parent, name=out.name)
    if folder:
        remove_stale_temps_below(out)
    return out

"""An export folder that appears whole or not at all: built beside ``out``, checked, renamed into place.

``check_out_folder`` refuses a non-empty ``out`` (a user's folder, an earlier export) unless
``overwrite=true``, before any model is loaded. ``staged_folder`` yields a temporary sibling folder
(``.<name>.tmp-<host>-<pid>-*``, the names ``atomic_write`` gives its files); once the caller has
written and checked it, it becomes ``out`` by one rename. Replacing a non-empty folder swaps the two
with Linux's ``renameat2(RENAME_EXCHANGE)``, then deletes the old one, so a ``kill -9`` at any moment
leaves the old export or the new one under ``out``, never a mix; what a killed export leaves beside
it is a temporary folder that the next export to the same ``out`` removes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vitpipe.errors import ConfigError
from vitpipe.run.files import fsync_path, remove_stale_temp_files, temp_dir_beside


def not_empty_error(out: Path) -> ConfigError | None:
    """The refusal for a non-empty existing ``out`` folder (None: absent or empty)."""
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not names:
        return None
    files = f"{len(names)} file{'s' if len(names) != 1 else ''}"
    return ConfigError(f"out={out} exists and is not empty (holds {files}, e.g. {names[0]}); "
                       "pass overwrite=true to replace it or choose another out=")


def check_out_folder(out: Path, *, overwrite: bool) -> None:
    if not overwrite and (error := not_empty_error(out)) is not None:
        raise error


@contextmanager
def staged_folder(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty folder beside ``out``; on a clean exit it replaces ``out`` (see the module docstring),
    on an exception it is removed and ``out`` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out.parent, name=out.name)  # what earlier killed exports left
    check_out_folder(out, overwrite=overwrite)
    tmp = temp_dir_beside(out)
    try:
        yield tmp
        for p in tmp.iterdir():  # after a power cut the renamed folder holds whole files
            fsync_path(p)
        _publish(tmp, out, overwrite=overwrite)
    finally:
        _remove(tmp)  # the failed stage, or (after a swap) the old folder
    fsync_path(out.parent)


def _publish(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; an old non-empty ``out`` stops it, or with ``overwrite`` is swapped to ``tmp``."""
    if not (overwrite and out.is_dir() and not_empty_error(out) is not None):
        try:
            os.rename(tmp, out)  # POSIX: replaces an empty folder, fails on a non-empty one
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if not overwrite:  # filled since the check: still the user's
                raise (not_empty_error(out) or e) from None
    if _exchange(tmp, out):
        return  # tmp now holds the old folder
    # no atomic swap here (not Linux, or a file system without it): the old folder moves aside first,
    # so for a moment there is no ``out``, and a kill then leaves the old export in a temporary folder beside it
    aside = temp_dir_beside(out)
    os.rename(out, aside)  # replaces the empty folder just made
    os.rename(tmp, out)
    _remove(aside)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (``renameat2(RENAME_EXCHANGE)``); False where that is unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)

"""Writing files safely: every file vitpipe writes goes through here.

- ``atomic_write(path, write)`` / ``atomic_write_text`` / ``atomic_write_json``: write to a temporary
  file in the same directory, fsync, then rename over the target. A kill during a write leaves the
  previous file intact (rename is atomic on POSIX), never a truncated file under the real name; a
  failed write (a full disk) removes its temporary file and raises ``DiskFullError`` naming the path.
  Files get the permissions the user's umask gives (``mkstemp`` alone would make them 0600).
- ``temp_dir_beside``: a temporary folder named like those files (a folder published by a rename).
- ``remove_stale_temp_files``: the temporary files and folders of writes whose process was killed;
  ``remove_stale_temps_below``: the same for a folder and its subfolders (every command, at its start).
- ``user_permissions``: a file another library wrote 0600 (safetensors) gets the user's umask.
- ``save_figure``: a matplotlib figure as a PNG, through ``atomic_write`` (the report's and viz's figures).
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_FULL = (errno.ENOSPC, errno.EDQUOT)
STALE_AFTER_S = 3600  # a temporary file of another host older than this is no save in progress


class DiskFullError(OSError):
    """A write failed for lack of space; its temporary file is gone and the old file untouched."""

    def __init__(self, code: int, path: Path) -> None:
        super().__init__(code, os.strerror(code), str(path))


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error in ``exc``'s chain (torch's writer wraps it), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def user_umask() -> int:
    try:  # Linux reports it without changing it (os.umask can only set, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_prefix(name: str) -> str:
    # the writer's host and pid in the name: a later run can tell a killed save from a running one
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name))
        os.fchmod(fd, 0o666 & ~user_umask())  # teammates read checkpoints as they read the user's other files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        full = disk_full_cause(e)
        if full is not None:
            raise DiskFullError(full.errno, path) from e
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory to make a rename durable: after a power cut the directory entry
    points at the new file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


_TEMP_NAME = re.compile(r"\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")


def _writer_may_be_alive(p: Path) -> bool:
    m = _TEMP_NAME.fullmatch(p.name)
    if m is None:
        return False  # an older vitpipe's temp name: no host/pid, and no running version writes it
    if m["host"] != socket.gethostname():
        return time.time() - p.stat().st_mtime < STALE_AFTER_S
    pid = int(m["pid"])
    if pid == os.getpid():
        return False  # this process calls between its own saves
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def temp_dir_beside(path: Path) -> Path:
    """A new empty folder beside ``path``, named as ``atomic_write`` names its temporary files (so a
    killed writer's folder is found by ``remove_stale_temp_files``), with the user's umask."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path.name)))
    tmp.chmod(0o777 & ~user_umask())
    return tmp


def remove_stale_temp_files(directory, name: str | None = None) -> list[Path]:
    """Delete the ``.<name>.tmp-*`` files in ``directory`` whose writer was killed mid-save.

    With ``name``: only those of writes to ``directory/name``, folders (``temp_dir_beside``) included,
    and only under the names this module gives them: ``directory`` may be any folder of the user's.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for p in directory.glob(".*.tmp-*" if name is None else f".{glob.escape(name)}.tmp-*"):
        try:
            if name is not None and not _TEMP_NAME.fullmatch(p.name):
                continue
            if p.is_file() and not _writer_may_be_alive(p):
                p.unlink()
                removed.append(p)
            elif name is not None and p.is_dir() and not p.is_symlink() and not _writer_may_be_alive(p):
                shutil.rmtree(p)
                removed.append(p)
        except FileNotFoundError:
            pass  # its writer finished (renamed it) meanwhile
    return removed


def remove_stale_temps_below(folder, *, depth: int = 2) -> list[Path]:
    """At a command's start: delete the temporary files and folders of our own writes (the names
    ``atomic_write`` and ``temp_dir_beside`` give) whose writer was killed, in ``folder`` and its
    subfolders ``depth`` levels down (a run's report/ and checkpoints/, visualize's <kind>/, a shard
    split). A name of another program (``.x.tmp-y``) and a live writer's file are left alone."""
    folder = Path(folder)
    removed, level = [], [folder] if folder.is_dir() and not folder.is_symlink() else []
    for _ in range(depth + 1):
        below = []
        for d in level:
            try:
                children = list(d.iterdir())
            except OSError:
                continue
            for p in children:
                if _TEMP_NAME.fullmatch(p.name):
                    try:
                        if _writer_may_be_alive(p):
                            continue
                        if p.is_dir() and not p.is_symlink():
                            shutil.rmtree(p)
                        else:
                            p.unlink()
                        removed.append(p)
                    except FileNotFoundError:
                        pass  # its writer finished (renamed it) meanwhile
                elif p.is_dir() and not p.is_symlink() and not p.name.startswith("."):
                    below.append(p)
        level = below
    return removed


def atomic_write_text(path, text: str) -> None:
    """``atomic_write`` of a text file (UTF-8)."""
    atomic_write(Path(path), lambda f: f.write(text.encode()))


def atomic_write_json(path, data, *, indent: int | None = 1) -> None:
    """``atomic_write`` of ``data`` as JSON."""
    atomic_write_text(path, json.dumps(data, indent=indent))


def user_permissions(path) -> None:
    """Give a file the permissions the user's umask gives (safetensors writes its files 0600)."""
    Path(path).chmod(0o666 & ~user_umask())


def save_figure(fig, path, *, dpi: int = 100) -> Path:
    """Write the matplotlib ``fig`` as a PNG of exactly its size in inches x ``dpi`` (no tight bbox)
    through ``atomic_write`` (a kill never leaves half a PNG), parents created; returns the path.

    Takes the figure object, so matplotlib is imported only by whoever drew it.
    """
    path = Path(path)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:  # a pyplot-made figure (a notebook's) would otherwise stay in its registry; never import it ourselves
        pyplot.close(fig)
    return path

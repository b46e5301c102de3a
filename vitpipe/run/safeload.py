"""Reading a torch file someone hands us: one bounded, code-free load (``safe_torch_load``).

Every ``torch.load`` of a user-handed file (``ckpt_path``, ``model.pretrained``, a captioner's
``encoder_ckpt``, a distillation teacher, a run's checkpoints when ``ckpt_path`` is resolved) goes
through here, for two reasons:

- ``weights_only=True``: no pickled object is rebuilt, so loading runs no code from the file.
- The archive's declared sizes are checked before anything is inflated. ``torch.save`` writes a zip
  archive whose records are *stored* (never compressed), so a checkpoint's records together declare
  about what it occupies on disk. ``torch.load`` allocates and inflates each record at its declared
  size before it looks at what the record holds: a 1.9 MB archive of deflated zeros made it take
  2.9 GB before refusing. A file whose records declare more than ``MAX_INFLATION`` times its size
  on disk (plus ``SLACK_BYTES`` for the few tiny records of a small file) is refused in one line,
  nothing inflated: real checkpoints are float weights, which no compressor shrinks by even 2x.

The legacy (pre-zip, torch < 1.6) format is refused too: its storage sizes are only known while
it is unpickled, so they cannot be bounded beforehand; ``torch.save`` has written zip archives
since 2020, and a legacy file re-saves with ``torch.save(torch.load(f))`` where it is trusted.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from vitpipe.errors import ConfigError

MAX_INFLATION = 2.0  # declared bytes / bytes on disk; torch.save's stored records give ~1.0
SLACK_BYTES = 1 << 20  # a small file's headers and tiny records (version, byteorder) never trip the ratio


def check_archive(path, *, what: str = "checkpoint") -> None:
    """ConfigError (one line naming ``path``) unless ``path`` is a zip archive whose records declare
    no more than ``MAX_INFLATION`` times its size on disk; reads only the zip's directory.
    Safetensors files are not zips and not checked here (their reader bounds them by the file)."""
    path = Path(path)
    try:
        on_disk = path.stat().st_size
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except zipfile.BadZipFile:
        if _is_legacy_pickle(path):
            raise ConfigError(f"cannot read {what} {path}: it is in torch's legacy (pre-1.6) format, whose sizes "
                              "cannot be checked before loading; re-save it with torch.save, which writes "
                              "the zip format") from None
        return  # not a zip: torch.load's own error says what it is (the caller words it)
    except OSError:
        return  # unreadable: torch.load's error names it the same way
    declared = sum(i.file_size for i in infos)
    packed = sum(i.compress_size for i in infos)
    bound = MAX_INFLATION * on_disk + SLACK_BYTES
    if declared > bound or packed > on_disk:
        raise ConfigError(f"refused {what} {path}: its records declare {_mb(declared)} uncompressed in a "
                          f"{_mb(on_disk)} file (more than {MAX_INFLATION:g}x; torch.save stores records uncompressed), "
                          "so loading it would inflate it in memory; nothing was loaded")


def safe_torch_load(path, *, what: str = "checkpoint", mmap: bool = False):
    """``torch.load(path, weights_only=True)`` on the CPU after ``check_archive``; ``mmap``: tensors
    stay on disk (reading a few small values of a large file). Exceptions of ``torch.load`` propagate
    (the caller words them); the size refusal is a ConfigError."""
    import torch

    check_archive(path, what=what)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def not_a_checkpoint(path) -> str | None:
    """Why the file at ``path`` cannot be a checkpoint, judged by its first bytes (no torch): empty, or neither
    a zip archive (what torch.save writes) nor a pickle; None when it may be one (torch.load decides)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "the file is empty."
    if head.startswith(b"PK") or head[:1] == b"\x80":  # a torch.save zip archive / an old-style pickle
        return None
    return "it is not a PyTorch checkpoint (torch.save writes a zip archive); pass a .ckpt written by scripts/train.py."


def _is_legacy_pickle(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"  # a pickle protocol opcode: torch's legacy format starts with one
    except OSError:
        return False


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"

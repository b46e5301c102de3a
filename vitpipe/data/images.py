"""Image files: which files are images, 8-bit upright pixels out of them, a full-decode check of many.

One rule for every path that reads image files (image folders, make_shards, predict): a visible
file whose extension is in ``IMAGE_EXTENSIONS`` is an image (``is_image_file``), and
``open_image`` opens it (shards decode their stored bytes with it too). ``open_image`` turns the
pixels upright by the file's EXIF orientation (a phone photo stored sideways with orientation 6
loads as it is shown) and scales 16-bit grayscale (PIL mode ``I;16``, e.g. 16-bit PNGs) by its bit
depth; PIL's own ``convert("RGB")`` clips it, so every such image would load as all-white.
``find_bad_images`` decodes every file (headers alone miss a truncated JPEG) in a thread pool and
remembers the files that decoded, by path + mtime + size, so a second run decodes only new files.
"""

import errno
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
from tqdm import tqdm

from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write_json
from vitpipe.run.jsonfiles import loads

# torchvision's IMG_EXTENSIONS and GIF (its first frame): formats Pillow decodes in every build
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
PROGRESS_MIN_FILES = 1000  # fewer files decode in seconds: no progress bar


def is_image_file(path) -> bool:
    """Whether ``path`` names an image file: visible (``._x.jpg`` is macOS metadata), an image extension."""
    name = os.path.basename(str(path))
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def open_image(path, mode: str = "RGB") -> Image.Image:
    """The image at ``path`` (a file name or a binary file object) fully decoded, upright, as 8-bit
    ``mode`` ("RGB" or "L").

    Raises OSError/ValueError for a file that is not a readable image, naming why.
    """
    with Image.open(path) as im:
        im.load()  # a decoding error surfaces here, before the EXIF block is read
        try:
            ImageOps.exif_transpose(im, in_place=True)  # keeps im.format, read below
        except Exception:  # noqa: BLE001 - a malformed EXIF block: the pixels as stored, as before
            pass
        # PNG stores at most 16 bits a sample; older Pillows open 16-bit gray PNGs as mode I
        if im.mode in SIXTEEN_BIT_MODES or (im.mode == "I" and im.format == "PNG"):
            pixels = np.clip(np.asarray(im, dtype=np.int64), 0, 65535) >> 8  # 16 -> 8 bits
            return Image.fromarray(pixels.astype(np.uint8), "L").convert(mode)
        if im.mode in ("I", "F"):
            raise ValueError(f"{im.mode} ({'32-bit int' if im.mode == 'I' else 'float'}) pixels have no known "
                             "range; save the image with 8 or 16 bits")  # fmt: skip
        return im.convert(mode)


def why_unreadable(err: Exception, path) -> str:
    """A short reason ``path`` could not be read, without the path (the caller names the file once)."""
    if isinstance(err, OSError) and err.errno == errno.ELOOP:
        return "symbolic link loop"
    if isinstance(err, FileNotFoundError):
        return "broken symbolic link" if os.path.islink(path) else "no such file"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror  # e.g. "Permission denied"; str(err) repeats the path
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text.replace(repr(str(path)), "").replace(str(path), "").strip(" :") or type(err).__name__


def load_image(path: str) -> Image.Image:
    """The training-time loader of image folders (one class or a label set per image), naming the file if it
    fails (e.g. changed since the check)."""
    try:
        return open_image(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read image {path}: {why_unreadable(err, path)}") from err


def _decode_error(path: str) -> str | None:
    """Why the file at ``path`` does not decode, or None if it does."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        open_image(path)
    except Exception as err:  # PIL raises many types for broken files
        return why_unreadable(err, path)
    return None


def find_bad_images(paths: list[str], *, folder: str) -> dict[str, str]:
    """``{path: why}`` for the files that do not decode, in the order given.

    Decodes in threads (PIL releases the GIL while decoding); files that decoded before with the
    same mtime and size are not decoded again (cache: one JSON file per ``folder``).
    """
    cache = _cache_file(folder)
    try:
        known = loads(cache.read_text())  # depth-bounded (vitpipe.run.jsonfiles): a broken cache is just rebuilt
    except (OSError, ValueError):
        known = {}
    stamps = {p: _stamp(p) for p in paths}
    todo = [p for p in paths if stamps[p] is None or known.get(p) != stamps[p]]
    bar = dict(total=len(todo), desc=f"decoding images in {folder}", unit="img",
               disable=len(todo) < PROGRESS_MIN_FILES)  # fmt: skip
    with ThreadPoolExecutor() as pool:
        errors = list(tqdm(pool.map(_decode_error, todo), **bar))
    bad = {p: why for p, why in zip(todo, errors) if why is not None}
    if todo:
        _write_atomic(cache, {p: s for p, s in stamps.items() if p not in bad and s is not None})
    return {p: bad[p] for p in paths if p in bad}


def _stamp(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _cache_file(folder: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vitpipe" / "decoded-images"
    return base / (hashlib.sha1(os.path.abspath(folder).encode()).hexdigest()[:16] + ".json")


def _write_atomic(path: Path, data: dict) -> None:
    """Best effort: a cache that cannot be written (read-only home) only costs the next run time."""
    try:
        atomic_write_json(path, data, indent=None)  # concurrent ranks never read half a file
    except OSError:
        pass

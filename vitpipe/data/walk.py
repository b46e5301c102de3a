"""Listing an image folder's files without following a directory link into a loop or twice: torchvision's
ImageFolder walks with ``os.walk(followlinks=True)``, which files ``train/cat/loop -> ..`` round and round
(images of every class under cat, many times over). Used by ``vitpipe.data.imagefolder``.
"""

from __future__ import annotations

import os

from vitpipe.data.images import is_image_file
from vitpipe.errors import ConfigError

SPLITS = ("train", "val", "test")


def _holds(a: str, b: str) -> bool:
    """Whether real folder ``a`` is ``b`` or holds it."""
    return a == b or b.startswith(a.rstrip(os.sep) + os.sep)


class LinkSafeWalk:
    """Image files under the class folders of one split, directory links followed only when safe.

    A directory link is followed once, to a folder outside the splits (train/, val/, test/) and
    outside every folder followed so far. Any other is refused with a ConfigError naming it: a link
    to a folder holding it loops (``train/cat/loop -> ..``), a link into a split repeats its images
    (under another class when it points elsewhere, training images in val/ for ``val/cat ->
    ../train/cat``), a second link to one folder counts its images twice.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.splits = [os.path.realpath(os.path.join(root, s)) for s in SPLITS if os.path.isdir(os.path.join(root, s))]
        self.followed: list[str] = []  # real folders reached through a link
        self.others: list[str] = []  # files that are not images

    def _refusal(self, path: str, target: str) -> str | None:
        """Why the directory link ``path`` (to real folder ``target``) is not followed, or None."""
        if _holds(target, os.path.realpath(os.path.dirname(path))):
            return "a folder that holds the link (a loop)"
        for split in self.splits:
            if _holds(target, split):
                return f"which holds {split} (a loop)"
            if _holds(split, target):
                return f"inside {split} (its images would be listed again)"
        if any(_holds(target, f) or _holds(f, target) for f in self.followed):
            return "a folder another link reaches already (its images would count twice)"
        return None

    def _check_link(self, path: str) -> None:
        target = os.path.realpath(path)
        why = self._refusal(path, target)
        if why is not None:
            raise ConfigError(f"imagefolder: {os.path.relpath(path, self.root)} is a directory link to {target}, "
                              f"{why}; directory links are followed only to folders outside train/, val/ and "
                              "test/, each once: remove the link")  # fmt: skip
        self.followed.append(target)

    def files(self, class_dir: str) -> list[str]:
        """The image files under ``class_dir``, in torchvision's order (sorted folders, then names)."""
        if os.path.islink(class_dir):
            self._check_link(class_dir)
        listed, todo = [], [class_dir]
        while todo:
            folder = todo.pop()
            names, subdirs = [], []
            with os.scandir(folder) as entries:
                for e in entries:
                    try:
                        is_dir = e.is_dir()  # follows a link: checked first
                    except OSError:  # a link in a loop: a file, which the decode check names
                        is_dir = False
                    if is_dir:
                        if e.is_symlink():
                            self._check_link(e.path)
                        subdirs.append(e.path)
                    elif is_image_file(e.name):
                        names.append(e.path)  # a link that loops or dangles: named by the decode check
                    else:
                        self.others.append(e.path)
            listed.append((folder, sorted(names)))
            todo += subdirs
        return [path for _, names in sorted(listed) for path in names]

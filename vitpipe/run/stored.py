"""The one rule for the paths a stored run config names, shared by its writer and its reader.

A checkpoint carries its run's config (``vitpipe.run.info.ConfigInCheckpoint``) and may be read on
another machine, or handed to us by someone else, so where data lives is never taken from it: its
``data.root`` moves under the current ``paths.data_dir`` (``vitpipe.run.checkpoint.rebuild``). The
other paths of the data section (``data.labels``, ``data.splits.<split>.<key>``, any other string)
are read relative to that root, so each is classified by ``data_path`` against the stored root:

    inside the root   stored, and read back, relative to it: ``data.labels=$D/labels.csv`` with
                      ``data.root=$D`` is ``labels.csv`` (``a/../b.csv``: ``b.csv``), and it moves
                      with the root
    outside the root  kept as given by the writer (config.yaml and the checkpoint say where the run
                      read it); the reader does not follow it: the file's name alone, under the
                      current root, as for the root itself (an eval from the stored data section
                      then looks there and names what it misses; predict, export, serve and demo
                      read no data file)

``LOCAL_KEYS`` say where this machine keeps things (a download cache, storage credentials and
endpoints): the writer keeps them, the reader drops them to their defaults (None).

``portable_data(data, reading=...)`` applies the rule to a whole data section: the writer with
``reading=False`` (config.yaml and the checkpoint, which stay equal), the reader with ``reading=True``.
Whatever training accepts therefore loads in eval, predict, export, serve and demo; model and module
paths (``model.pretrained``, ``model.encoder.encoder_ckpt``, ``module.distill.teacher``) are read
only while training starts and are never followed from a stored config (``rebuild`` clears the first
two; a teacher is loaded only by a fit).
"""

from __future__ import annotations

import copy
import posixpath

LOCAL_KEYS = ("cache_dir", "storage_options")  # where this machine keeps things: never from a stored config
_NOT_PATHS = ("_target_", "root")


def data_path(value: str, root) -> str | None:
    """``value`` (a path named in a data section whose root is ``root``) relative to the root, normalised,
    when it lies inside it; None when it lies outside (absolute elsewhere, ``~``, or escaping with ``..``)."""
    value = posixpath.expanduser(value) if value.startswith("~") else value
    if posixpath.isabs(value):
        if not isinstance(root, str) or not root:
            return None
        base = posixpath.normpath(posixpath.abspath(posixpath.expanduser(root)))
        rel = posixpath.relpath(posixpath.normpath(value), base)
    else:
        rel = posixpath.normpath(value)
    if rel == ".." or rel.startswith("../") or posixpath.isabs(rel) or rel.startswith("~"):
        return None
    return rel


def portable_data(data: dict, *, reading: bool) -> dict:
    """A copy of the data section ``data`` with the rule of the module docstring applied to every string
    it names besides ``_target_`` and ``root``: top-level values and ``splits.<split>.<key>``."""
    data = copy.deepcopy(data)
    root = data.get("root")

    def one(value):
        if not isinstance(value, str) or "://" in value or ("/" not in value and not value.startswith("~")):
            return value  # a plain word (folders, none, labels.csv) or a URL: no local place to move
        rel = data_path(value, root)
        if rel is not None:
            return rel
        if not reading:
            return value
        return posixpath.basename(posixpath.normpath(value)) or None

    for key, value in data.items():
        if key in LOCAL_KEYS:
            data[key] = None if reading else value
        elif key not in _NOT_PATHS and isinstance(value, str):
            data[key] = one(value)
    splits = data.get("splits")
    if isinstance(splits, dict):
        for spec in splits.values():
            if isinstance(spec, dict):
                for key, value in spec.items():
                    spec[key] = one(value)
    return data


def stored_config(config: dict) -> dict:
    """The resolved run config ``config`` as the writer stores it (config.yaml and every checkpoint):
    its data section through ``portable_data(reading=False)``."""
    if isinstance(config.get("data"), dict):
        config = {**config, "data": portable_data(config["data"], reading=False)}
    return config

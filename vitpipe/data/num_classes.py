"""``data.num_classes: null``: the class count the data's own files give, written into the config
(and ``data.channels: null`` likewise, where the files say it: a shard index).

An image folder counts its train/ class folders, shards read their ``vitpipe_shards.json``: the
data module class says how (``num_classes_of(data_cfg)``). This runs when the config is checked,
before anything is built, so ``model.num_classes`` (``${data.num_classes}``) follows and the config
stored with the run (and in its checkpoints) carries the number. A count given in the config is
left as it is; the data module checks it against the files.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from vitpipe.errors import ConfigError

# What a data config may leave null for its files to say. A data class reads them with ``facts_of(data)``
# (several from one read: a shard index holds the class and channel counts, so model.in_chans =
# ${data.channels} follows grayscale shards, and mean/std and the native size) or, for the class count
# alone, ``num_classes_of(data)`` (an image folder's class folders).
FACTS = ("num_classes", "channels", "mean", "std", "native_size")


def resolve_num_classes(data) -> None:
    """Fill ``data.num_classes`` (and the other FACTS the data's target reads) in place when null."""
    if not isinstance(data, DictConfig):
        return
    try:
        if "root" in data and OmegaConf.is_missing(data, "root"):
            return
        null = [k for k in FACTS if k in data and not OmegaConf.is_missing(data, k) and data[k] is None]
        target = data.get("_target_")
    except OmegaConfBaseException:
        return  # a bad interpolation: the config checks name it
    if not null:
        return  # given, or missing (???): the config checks name what to set
    cls = _data_class(target)
    if hasattr(cls, "facts_of"):
        try:
            facts = cls.facts_of(data)
        except ConfigError:
            if "num_classes" in null or "channels" in null:
                raise
            return  # only mean/std/native size left to the files: the data module reads them and says what is wrong
        found = {k: facts[k] for k in null if k in facts}
    elif "num_classes" in null and hasattr(cls, "num_classes_of"):
        found = {"num_classes": int(cls.num_classes_of(data))}
    else:
        return
    with open_dict(data):
        for key, value in found.items():
            data[key] = value


def _data_class(target):
    """The class a vitpipe data target names, or None (anything else is never imported here)."""
    if not isinstance(target, str) or not target.startswith("vitpipe.data."):
        return None
    from hydra.utils import get_class

    try:
        return get_class(target)
    except Exception:  # noqa: BLE001 - the config checks name a target that cannot be imported
        return None

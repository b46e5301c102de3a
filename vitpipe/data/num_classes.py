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


# key -> the data class's static method that reads it from the data's files (shards: the index also
# holds the channel count, so data.channels null gives model.in_chans = ${data.channels} its number)
FROM_FILES = {"num_classes": "num_classes_of", "channels": "channels_of"}


def resolve_num_classes(data) -> None:
    """Fill ``data.num_classes`` (and ``data.channels``) in place when null and the data's target can
    read it from its files."""
    if not isinstance(data, DictConfig):
        return
    for key, method in FROM_FILES.items():
        if key not in data:
            continue
        try:
            if OmegaConf.is_missing(data, key) or data[key] is not None:
                continue  # given, or missing (???): the config checks name what to set
            if OmegaConf.is_missing(data, "root"):
                return
            target = data.get("_target_")
        except OmegaConfBaseException:
            return  # a bad interpolation: the config checks name it
        count = getattr(_data_class(target), method, None)
        if count is not None:
            with open_dict(data):
                data[key] = int(count(data))


def _data_class(target):
    """The class a vitpipe data target names, or None (anything else is never imported here)."""
    if not isinstance(target, str) or not target.startswith("vitpipe.data."):
        return None
    from hydra.utils import get_class

    try:
        return get_class(target)
    except Exception:  # noqa: BLE001 - the config checks name a target that cannot be imported
        return None

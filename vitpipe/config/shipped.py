"""The configs vitpipe ships: where every command finds them, their names, and copying one out to edit.

The checkout's ``conf/`` is the package ``vitpipe.conf``: ``vitpipe/conf`` links to it, and a wheel carries
the same files as package data (pyproject.toml). So every command composes from Hydra's
``pkg://vitpipe.conf``, whether vitpipe runs from a checkout (``pip install -e .``) or from a wheel, and from
any working directory: no path is taken relative to a checkout or to where the command was started.

A user's own folder joins with Hydra's ``--config-dir DIR``. Hydra searches it *after* the shipped configs,
so a file there named like a shipped one (``DIR/model/vit_s4.yaml``) would be passed over without a word;
``shadowed`` names those so the command can refuse them. ``vitpipe cp`` (torchtune's ``tune cp``) copies a
shipped config out to edit under a new name.
"""

from __future__ import annotations

from pathlib import Path

from vitpipe.config.checks import did_you_mean
from vitpipe.errors import ConfigError
from vitpipe.run.files import atomic_write_text

CONFIG_MODULE = "vitpipe.conf"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"  # the config_path of every command's @hydra.main
CONF_DIR = (Path(__file__).resolve().parents[1] / "conf").resolve()  # the same folder, for compose() and reading


def names() -> list[str]:
    """Every shipped config by the name Hydra knows it: ``train``, ``model/vit_s4``, ``hydra/launcher/slurm``."""
    return sorted(p.relative_to(CONF_DIR).with_suffix("").as_posix() for p in CONF_DIR.rglob("*.yaml"))


def copy_config(name: str, dest) -> Path:
    """Copy the shipped config ``name`` (``.yaml`` optional) to ``dest``: a ``.yaml`` file, else a folder
    (made if missing) where it keeps its file name. An existing file is never replaced. Returns the path
    written; ConfigError (one line) for an unknown name or a taken destination."""
    key = name.removesuffix(".yaml")
    known = names()
    if key not in known:
        group = key.rpartition("/")[0]
        near = [n for n in known if n.rpartition("/")[0] == group] or known  # model/vit_s5: the model group
        raise ConfigError(f"{name} is not a shipped config" + did_you_mean(key, near, shown=12))
    source = CONF_DIR / f"{key}.yaml"
    dest = Path(dest).expanduser()
    target = dest if dest.suffix == ".yaml" else dest / source.name
    if target.exists() or target.is_symlink():
        raise ConfigError(f"{target} exists; vitpipe cp never replaces a file: remove it or pass another destination")
    if target.parent.exists() and not target.parent.is_dir():
        raise ConfigError(f"{target.parent} is a file, not a folder; pass another destination")
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, source.read_text(encoding="utf-8"))
    return target


def shadowed(config_dir) -> list[str]:
    """The configs of a user's ``--config-dir`` that Hydra would pass over: those named like a shipped one."""
    root = Path(config_dir).expanduser()
    if not root.is_dir():
        return []  # Hydra reports a missing folder itself
    mine = {p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml")}
    return sorted(mine & set(names()))

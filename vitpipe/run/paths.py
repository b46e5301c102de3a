"""Which run, and which checkpoint of it, a path means; where a run's files live.

Which checkpoint ``ckpt_path`` means (``resolve_ckpt_path``, used by train, eval, visualize,
predict and export):

    a file       that file
    a directory  the run it holds (the newest one when it holds several, e.g. logs/train/), then
                 which="best": the checkpoint ModelCheckpoint recorded as best (best_model_path in
                               last.ckpt, else in the newest checkpoint), found by name in the folder
                               (a moved run still finds it); with nothing recorded yet, the one
                               checkpoint besides last.ckpt, else last.ckpt; a folder holding one
                               checkpoint: that one. A recorded best that is not in the folder, or
                               several checkpoints and no readable record, is refused (ConfigError,
                               one line naming the files): no other file stands in for it. Eval,
                               visualize, predict and export use "best": the weights the run's own test used.
                 which="last": last.ckpt, the newest state (else the newest checkpoint). Train's resume.
    last         the newest run under ``log_dir`` that the command can use, then as for a directory

When a directory holds several runs (``last``, or e.g. ``logs/train/``), runs still being written
(their process alive) are passed over, and so are runs the command cannot use (``usable``, read
cheaply from each run's config.yaml: train's resume takes a run of its own task and model, predict,
serve, demo and visualize a classifier or captioner run, export a classifier run: ``ckpt_path=last``
after an MAE pre-training run is the newest classifier run, not the MAE one). The run chosen is
printed with its kind and what was passed over (a sweep job is named as one); none fitting is one line.

``run_dir_of`` is the one place that maps a checkpoint to its run directory (``<run>/checkpoints/x.ckpt``
-> ``<run>``: its history.csv, calibration.json, config.yaml); ``default_paths`` is
``conf/paths/default.yaml`` for callers outside a Hydra run (a notebook's ``load_from_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch import nn

from vitpipe.config.shipped import CONF_DIR  # the shipped Hydra configs (checkout or wheel)
from vitpipe.errors import ConfigError
from vitpipe.run.dirs import CHECKPOINTS, is_live
from vitpipe.run.stored import STATE_DICT, config_in, net_shapes, peek, recorded_best


def default_paths() -> DictConfig:
    """``conf/paths/default.yaml`` resolved outside a Hydra run: rooted at the working directory, output
    there too (no Hydra run directory exists)."""
    spec = CONF_DIR / "paths" / "default.yaml"
    if not spec.is_file():
        raise ConfigError(f"{spec} is missing: this vitpipe install lacks its configs (vitpipe/conf); reinstall it")
    paths = OmegaConf.load(spec)
    paths.output_dir = "${paths.root_dir}"  # was ${hydra:runtime.output_dir}
    return OmegaConf.create(OmegaConf.to_container(OmegaConf.create({"paths": paths}), resolve=True)["paths"])


def resolve_ckpt_path(value, *, log_dir=None, which: str = "best", usable: Usable | None = None) -> Path:
    """The checkpoint file ``value`` (a file, a run directory or ``last``) means; see the module
    docstring for the rule. ``log_dir``: where ``last`` looks. ``usable``: where a search picks among
    several runs, ``usable(checkpoint folder)`` says why a run does not fit this command (None: it fits;
    e.g. ``needs_kinds``), and the newest run that fits is taken. Raises ConfigError."""
    if which not in ("best", "last"):
        raise ValueError(f"which={which!r}; valid choices: best, last")
    if value is None or str(value) == "":
        raise ConfigError("ckpt_path is not set; pass ckpt_path=<a .ckpt file, a run directory or `last`>")
    if str(value) == "last":
        if log_dir is None:
            raise ConfigError("ckpt_path=last needs a log directory to search; pass a .ckpt file or a run directory")
        run = _newest_run(Path(log_dir), what="ckpt_path=last", usable=usable)
        if run is None:
            raise ConfigError(f"ckpt_path=last: no checkpoint under {log_dir}; pass ckpt_path=<file or run dir>")
        return _pick(run, which, "ckpt_path=last")
    path = Path(str(value)).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        run = _newest_run(path, what=f"ckpt_path={value}", usable=usable)
        if run is None:
            raise ConfigError(f"ckpt_path={value}: that directory holds no .ckpt file; "
                              "pass a checkpoint file or a run directory")
        return _pick(run, which, f"ckpt_path={value}")
    raise ConfigError(f"ckpt_path={value}: no such file or directory; pass a .ckpt file, a run directory or `last`")


def run_dir_of(path) -> Path:
    """The run directory a checkpoint file or checkpoint folder belongs to: ``<run>/checkpoints/x.ckpt``
    and ``<run>/checkpoints/`` -> ``<run>``; a checkpoint elsewhere -> its folder."""
    path = Path(path)
    folder = path.parent if path.suffix == ".ckpt" or path.is_file() else path
    return folder.parent if folder.name == CHECKPOINTS else folder


def _newest_run(root: Path, *, what: str, usable: Usable | None = None) -> Path | None:
    """The checkpoint folder of ``root``'s newest run, or None. When ``root`` holds several runs, runs
    whose process is still alive (``vitpipe.run.dirs.is_live``) are passed over, and so are runs that
    ``usable`` says this command cannot use (another task or model); the choice is printed (always for
    ``last``): which run, whether it is a sweep job, what was skipped. No run fits: ConfigError, one line."""
    found = [p for p in root.rglob("*.ckpt") if p.is_file()]
    if not found:
        return None
    newest: dict[Path, float] = {}
    for p in found:
        newest[p.parent] = max(newest.get(p.parent, 0.0), p.stat().st_mtime)
    folders = sorted(newest, key=newest.get, reverse=True)
    if len(folders) == 1 and what != "ckpt_path=last":  # the run directory itself was given
        if is_live(run_dir_of(folders[0])):
            _say(f"vitpipe: {what}: that run is still being written; using its newest checkpoint as it is now")
        return folders[0]
    alive = [f for f in folders if is_live(run_dir_of(f))]
    done = [f for f in folders if f not in alive]
    if not done:
        raise ConfigError(f"{what}: every run under {root} is still running ({run_dir_of(alive[0])} is the newest); "
                          f"pass ckpt_path=<its run dir or a .ckpt file> to use a live run's checkpoint anyway")
    misfits: list[tuple[Path, str]] = []  # (newer run passed over, why), newest first
    chosen = None
    for folder in done:
        why = usable(folder) if usable is not None else None
        if why is None:
            chosen = folder
            break
        misfits.append((folder, why))
    if chosen is None:
        newest, why = misfits[0]
        raise ConfigError(f"{what}: none of the {len(done)} finished run(s) under {root} fits this command; the newest, "
                          f"{run_dir_of(newest)}, {why}; pass ckpt_path=<a run dir or .ckpt file that fits>")
    run = run_dir_of(chosen)
    sweep = (f", job {run.name} of the sweep {run.parent}" if (run.parent / "multirun.yaml").is_file() else "")
    kind = f" ({run_kind(run_config(chosen))})" if usable is not None else ""
    skipped = f"; passed over {len(alive)} run(s) still running, newest {run_dir_of(alive[0])}" if alive else ""
    if misfits:
        skipped += (f"; passed over {len(misfits)} newer run(s) this command cannot use, newest "
                    f"{run_dir_of(misfits[0][0])}: it {misfits[0][1]}")
    _say(f"vitpipe: {what} -> run {run}{kind}{sweep}{skipped}")
    return chosen


# --------------------------------------------------------------------------- which runs a command can use

Usable = Callable[[Path], "str | None"]  # checkpoint folder -> why this command cannot use its run, or None
MODULE_KINDS = {"vitpipe.lit.ImageClassifier": "classifier", "vitpipe.lit.captioner.CaptionModule": "captioner",
                "vitpipe.lit.mae.MAEModule": "MAE pre-training"}  # module._target_ -> what the run trained


def run_config(folder) -> dict | None:
    """The config of the run whose checkpoints are in ``folder``, read cheaply: its ``config.yaml`` (what
    train writes before fitting; equal to the config in its checkpoints), else ``.hydra/config.yaml``, else
    the config inside its newest checkpoint (memory-mapped, bounded: no weights are read); None if none reads.
    YAML is read as data (OmegaConf's safe loader); nothing in it is called."""
    run = run_dir_of(Path(folder) / "x.ckpt")
    for spec in (run / "config.yaml", run / ".hydra" / "config.yaml"):
        if spec.is_file():
            try:
                loaded = OmegaConf.to_container(OmegaConf.load(spec))
            except Exception:  # noqa: BLE001 - an unreadable file: try the next source
                continue
            if isinstance(loaded, dict) and isinstance(loaded.get("module"), dict):
                return loaded
    ckpts = sorted((p for p in Path(folder).glob("*.ckpt") if p.is_file()), key=lambda p: p.stat().st_mtime)
    try:
        return config_in(ckpts[-1]) if ckpts else None
    except Exception:  # noqa: BLE001 - unreadable: the kind is unknown
        return None


def run_kind(config: dict | None) -> str:
    """What a run trained, in words: classifier (multi-label classifier), captioner, MAE pre-training."""
    module = (config or {}).get("module") if isinstance(config, dict) else None
    target = module.get("_target_") if isinstance(module, dict) else None
    if target not in MODULE_KINDS:
        return "unknown kind" if target is None else f"module {target}"
    kind = MODULE_KINDS[target]
    return f"multi-label {kind}" if kind == "classifier" and module.get("task") == "multilabel" else kind


def a_kind(kind: str) -> str:
    return f"{'an' if kind[:1] in 'aeiuMo' else 'a'} {kind}"  # an MAE pre-training, an unknown kind, a classifier


def needs_kinds(*kinds: str, command: str) -> Usable:
    """A ``usable`` for commands that take runs of ``kinds`` (``MODULE_KINDS`` values; a multi-label
    classifier is a classifier): predict, serve, demo and visualize take classifiers and captioners,
    export classifiers. ``command`` names the command in the reason."""

    def usable(folder: Path) -> str | None:
        kind = run_kind(run_config(folder))
        base = kind.removeprefix("multi-label ")
        if base in kinds:
            return None
        return f"is {a_kind(kind)} run, and {command} takes {' or '.join(k + ' runs' for k in kinds)}"

    return usable


def resumable_by(net: nn.Module, cfg: DictConfig) -> Usable:
    """A ``usable`` for train's ``ckpt_path=last``: runs of the same kind as ``cfg`` (``run_kind``: its module and
    task, from the run's config.yaml) whose newest checkpoint has ``net``'s weights, key for key and shape for
    shape (read memory-mapped: no weights are loaded), as ``check_fits`` then requires of the one chosen."""
    want = run_kind(OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg)
    own = {k: tuple(v.shape) for k, v in net.state_dict().items()}

    def usable(folder: Path) -> str | None:
        kind = run_kind(run_config(folder))
        if kind != want:
            return f"is {a_kind(kind)} run, and this one trains {a_kind(want)}"
        last = folder / "last.ckpt"
        ckpts = [last] if last.is_file() else sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)[-1:]
        try:
            theirs = net_shapes(peek(ckpts[-1])[STATE_DICT])
        except Exception:  # noqa: BLE001 - an unreadable checkpoint fits nothing
            return f"has a checkpoint {ckpts[-1].name} that cannot be read"
        if theirs != own:
            return "holds weights of another model than the configured one"
        return None

    return usable


@rank_zero_only
def _say(line: str) -> None:
    print(line, flush=True)


def _pick(folder: Path, which: str, what: str) -> Path:
    last = folder / "last.ckpt"
    last = last if last.is_file() else None
    others = sorted((p for p in folder.glob("*.ckpt") if p.is_file() and p != last), key=lambda p: p.stat().st_mtime)
    if which == "last":
        return last or others[-1]
    if last is None and len(others) == 1:  # a folder holding one checkpoint (perhaps renamed): that one
        return others[0]
    # the best is what ModelCheckpoint recorded, in last.ckpt (else in the newest checkpoint); looked up
    # by name in this folder, so a moved or copied run still finds it, and never read from the path a
    # file names. When the record points nowhere here, no other file stands in for it: eval, predict and
    # export would report numbers the run never had under its name.
    recorder = last or others[-1]
    recorded, why = recorded_best(recorder)
    present = [p.name for p in [*others, *([last] if last else [])]]
    if recorded:
        name = PurePosixPath(recorded).name
        if (folder / name).is_file():
            return folder / name
        raise ConfigError(f"{what}: the run records {recorded} as its best checkpoint, but {folder} has no {name} "
                          f"(it holds {', '.join(sorted(present))}); pass ckpt_path=<one of those files>")
    if len(others) <= 1:  # nothing ranked yet: the one checkpoint besides last.ckpt, else last.ckpt
        return others[0] if others else last
    source = (f"{recorder.name}, which records it, cannot be read: {why}" if why
              else "none records it (no ModelCheckpoint state)")
    raise ConfigError(f"{what}: cannot tell which of {len(others)} checkpoints is the best: {source}; "
                      f"pass ckpt_path=<one of {', '.join(sorted(present))}>")


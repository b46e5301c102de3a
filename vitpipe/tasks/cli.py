"""Shared entry wrappers: mistakes and stops print one line, no traceback wall.

``hydra_main`` is the ``@hydra.main`` of every Hydra command (vitpipe/commands.py): it checks the command line before Hydra
composes it (Hydra reports an unknown key in its own words, with exit status 1, before any vitpipe
code runs); ``run_cli`` runs the script's body. Exit statuses: 0 done; 2 a configuration mistake;
3 a NaN/inf loss stopped training; 74 a full disk (EX_IOERR; earlier checkpoints are intact);
128 + signal for a stop by a signal: 143 SIGTERM, 130 SIGINT (Ctrl-C). A stop while fitting has
written a resumable ``last.ckpt`` first.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from vitpipe.config.checks import check_class_counts, check_wandb_login, did_you_mean
from vitpipe.config.options import check_out
from vitpipe.config.resolvers import composing_without_torch
from vitpipe.config.schema import ENTRY_SCHEMAS, check_schema, written_plainly
from vitpipe.config.shipped import CONF_DIR, CONFIG_PATH
from vitpipe.errors import ConfigError
from vitpipe.run.files import DiskFullError, disk_full_cause, remove_stale_temps_below
from vitpipe.run.outputs import check_not_input, check_writable, name_too_long, named_checkpoint_inputs
from vitpipe.run.safeload import check_archive, not_a_checkpoint

EXIT_CONFIG, EXIT_NONFINITE, EXIT_DISK_FULL = 2, 3, 74


def hydra_main(config_name: str):
    """``@hydra.main(version_base="1.3", config_path="pkg://vitpipe.conf", config_name=...)`` (the shipped
    configs, found the same from a checkout or a wheel: ``vitpipe.config.shipped``) whose command line is
    checked first (``command_line_mistake``): a mistake there is one line and exit status 2, and
    Hydra has not made a run or sweep directory yet."""

    def decorate(task):
        run = hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=config_name)(task)

        @functools.wraps(task)
        def main(cfg: DictConfig | None = None):
            if cfg is None:  # from the command line (Hydra passes a config through unchecked)
                mistake = command_line_mistake(CONF_DIR, config_name, sys.argv[1:])
                if mistake:
                    say_once(f"vitpipe: error: {mistake}")
                    sys.exit(EXIT_CONFIG)
            return run(cfg)

        return main

    return decorate


def command_line_mistake(conf: Path, config_name: str, argv: list[str]) -> str | None:
    """The first mistake of a script's command line that shows before a run starts, in one line, or
    None: an override naming a key the config lacks (``trainer.max_epoch=3``, with the closest valid
    key) or an option its group lacks (``model=vit_b61``), a value of the wrong type or out of range
    (``data.batch_size=abc``: ``vitpipe.config.schema``), a logger that cannot start (``logger=wandb``
    without a login), a class count that differs from the data's (``model.num_classes=7``) and a handed file
    that its first bytes refuse (``handed_file_mistake``). The overrides are composed once with Hydra's
    compose API, nothing resolved; in a multirun, the first job's. Whatever this cannot judge (Hydra's own
    flags, sweeps other than lists and ranges, other errors) is left to Hydra to report as before."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, MissingConfigException

    args = get_args_parser().parse_args(argv)
    if (args.help or args.hydra_help or args.info or args.shell_completion or args.experimental_rerun
            or args.config_path or args.config_dir or GlobalHydra.instance().is_initialized()):
        return None
    overrides = _first_job(args.overrides)
    if overrides is None:
        return None
    name = args.config_name or config_name
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"), composing_without_torch():
        try:
            cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
        except MissingConfigException as e:
            return _unknown_option(e, overrides, GlobalHydra.instance().config_loader())
        except ConfigCompositionException as e:
            key = _unknown_key(e)
            if key is None:
                return None
            others = [o for o in overrides if _key(o) != key]
            try:
                cfg = compose(config_name=name, overrides=others, return_hydra_config=True)
            except Exception:  # noqa: BLE001 - another mistake as well: this one is named alone
                return f"{key} is not a key of {key.rpartition('.')[0] or 'the config'}"
            return _unknown_key_message(key, cfg)
        except Exception:  # noqa: BLE001 - not a mistake this check knows: Hydra reports it as before
            return None
    mistake = (_search_space_mistake(cfg) or output_dir_mistake(cfg, name, multirun=args.multirun)
               or handed_file_mistake(cfg, name) or pretrained_mistake(cfg))
    if mistake:
        return mistake
    # the values' types and ranges, as the command's preflight checks them first (where=(): none for this command)
    values = functools.partial(check_schema, where=ENTRY_SCHEMAS.get(name, ()), plain_only=True)
    for check in (values, check_wandb_login, _class_counts):
        try:
            check(cfg)
        except ConfigError as e:
            return str(e)
        except Exception:  # noqa: BLE001 - a value that needs the run to resolve: its preflight checks again
            pass
    return None


def _search_space_mistake(cfg: DictConfig) -> str | None:
    """A search space (``hydra.sweeper.params``, Optuna's) naming a key this config lacks: Hydra would
    stop at the first trial with "Could not override". ``+key`` / ``++key`` add keys and pass."""
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
    if not isinstance(params, DictConfig):
        return None
    for name in params:
        key = str(name).split("@")[0]
        if key.startswith(("+", "~")) or _has_key(cfg, key):
            continue
        choices = OmegaConf.select(cfg, "hydra.runtime.choices", default={}) or {}
        search = choices.get("hparams_search")
        hint = ""
        if str(OmegaConf.select(cfg, "module._target_", default="")).endswith("MAEModule") and search != "optuna_mae":
            hint = "; an MAE pre-training is searched with hparams_search=optuna_mae"
        where = f"hparams_search={search}" if search else "hydra.sweeper.params"
        return f"{where} searches {key}, which this config lacks: {_unknown_key_message(key, cfg)}{hint}"
    return None


def output_dir_mistake(cfg: DictConfig, config_name: str, *, multirun: bool = False) -> str | None:
    """The run (or sweep) directory Hydra is about to create and write ``.hydra/`` into, checked before it
    does (``vitpipe.run.outputs``): one it cannot create or write (under a file, read-only, a full disk, a
    name too long: ``task_name`` included), and, for every script but train (which resumes into its own
    run), one that is, contains or lies inside the run ``ckpt_path=`` names. None when fine or when the
    directory is not known before the run (an interpolation that cannot be resolved here)."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    out = _output_dir(cfg, key)
    if out is None:
        return None
    long = name_too_long(out)
    task = str(OmegaConf.select(cfg, "task_name", default="") or "")
    if long is not None and long[0] and long[0] == task:
        return (f"task_name={task[:24]}... is {len(os.fsencode(task))} bytes, and it names the run's folder, "
                f"which may have at most {long[1]}: pass a shorter task_name")
    try:
        check_writable(out, key=key, folder=True)
        if config_name != "train":
            ckpt = OmegaConf.select(cfg, "ckpt_path", default=None, throw_on_missing=False)
            check_not_input(out, named_checkpoint_inputs(ckpt), key=key, folder=True)
    except ConfigError as e:
        return str(e)
    return None


def handed_file_mistake(cfg: DictConfig, config_name: str) -> str | None:
    """What the command line names that its first bytes or its place already refuse, as the command's body
    words it, before torch loads: predict's ``out=`` file (checked there before the checkpoint is read), then a
    ``ckpt_path=`` file that is empty or no checkpoint at all (a text file), and a ``ckpt_path=`` or
    ``model.pretrained=`` archive whose records declare more than its size allows (a zip bomb: read from the
    zip's directory alone, ``vitpipe.run.safeload``). Plain values only; a run directory, ``last`` and
    everything needing torch.load are the command's own checks."""
    try:
        if config_name == "predict" and _plain(cfg, "out"):
            check_out(cfg.out)
        if _plain(cfg, "ckpt_path") and "://" not in str(cfg.ckpt_path):
            path = Path(str(cfg.ckpt_path)).expanduser()
            if path.is_file():
                why = not_a_checkpoint(path)
                if why:
                    return f"cannot read checkpoint {path}: {why}"
                check_archive(path)  # as safe_torch_load words it for every reader of a checkpoint
        model = cfg.get("model")
        if isinstance(model, DictConfig) and _plain(model, "pretrained") and isinstance(model.pretrained, str):
            path = Path(model.pretrained)  # as vitpipe.models.weights reads it
            if path.is_file() and path.suffix != ".safetensors":
                check_archive(path, what="weights file")
    except ConfigError as e:
        return str(e)
    except OSError:  # unreadable: the command's own read words it
        return None
    return None


def pretrained_mistake(cfg: DictConfig) -> str | None:
    """``model.pretrained=true`` on a variant with timm weights (``model=vit_ti16``) whose weights the Hugging
    Face cache lacks while the Hub cannot be asked (HF_HUB_OFFLINE, or no answer to one request): the line
    the model's loader gives (``vitpipe.models.hub``), before torch and timm load. Plain values only."""
    from vitpipe.models.hub import cached_or_reachable, variant_hub_files
    from vitpipe.models.variants import TIMM_NAMES

    model = cfg.get("model")
    if not (isinstance(model, DictConfig) and _plain(model, "_target_") and model._target_ == "vitpipe.create_model"
            and _plain(model, "pretrained") and model.pretrained is True and _plain(model, "name")
            and model.name in TIMM_NAMES):
        return None
    timm_name = TIMM_NAMES[model.name]
    try:
        cached_or_reachable(timm_name, *variant_hub_files(timm_name))
    except ConfigError as e:
        return f"model: {e}"  # as the run words it (instantiate_checked names the config node)
    return None


def _class_counts(cfg: DictConfig) -> None:
    """The model's class count against the data's, where both are written plainly (``model.num_classes=7``
    on digits' 10): the preflight's rule and line."""
    model, data = cfg.get("model"), cfg.get("data")
    if isinstance(model, DictConfig) and isinstance(data, DictConfig) and _plain(model, "num_classes") \
            and _plain(data, "num_classes"):
        check_class_counts(model.num_classes, data.num_classes)


def _plain(cfg: DictConfig, key: str) -> bool:
    """``cfg.key`` is written plainly (``vitpipe.config.schema.written_plainly``) and not null."""
    return written_plainly(cfg, key) and cfg[key] is not None


def _output_dir(cfg: DictConfig, key: str) -> str | None:
    """``hydra.run.dir`` (``hydra.sweep.dir``) as a path, without claiming it (``${unique_dir:x}`` -> x)."""
    node = OmegaConf.select(cfg, key.rpartition(".")[0])
    if not isinstance(node, DictConfig):
        return None
    raw = OmegaConf.to_container(node, resolve=False).get("dir")
    if not isinstance(raw, str) or not raw:
        return None
    claimed = re.fullmatch(r"\$\{unique_dir:(.*)\}", raw.strip())
    raw = claimed.group(1) if claimed else raw
    if "${" not in raw:
        return raw
    probe = "_vitpipe_output_dir"
    try:
        with open_dict(cfg):
            cfg[probe] = raw
        return str(cfg[probe])
    except Exception:  # noqa: BLE001 - a resolver that needs the run (hydra:...): Hydra reports it later
        return None
    finally:
        with open_dict(cfg):
            cfg.pop(probe, None)


def _has_key(cfg: DictConfig, key: str) -> bool:
    """``a.b.c`` is a key of ``cfg`` (a config group's name counts), nothing resolved."""
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():  # noqa: SIM118 - `in` skips ??? keys
            return False
        leaf = OmegaConf.is_interpolation(node, part) or OmegaConf.is_missing(node, part)
        node = None if leaf else node[part]
    return True


def _first_job(overrides: list[str]) -> list[str] | None:
    """The overrides of a multirun's first job (``a=1,2`` -> ``a=1``), as Hydra's basic sweeper
    writes them; the overrides themselves when nothing sweeps; None when they cannot be read here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if not any(o.is_sweep_override() for o in parsed):
            return list(overrides)
        return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                else o.input_line for o in parsed]
    except Exception:  # noqa: BLE001 - a syntax error, an interval or glob sweep: Hydra's to report
        return None


def _key(override: str) -> str:
    return re.split(r"[=@]", override.lstrip("+~"), maxsplit=1)[0]


def _unknown_key(e: Exception) -> str | None:
    """The key of Hydra's "Could not override 'k'" / "Could not delete ... 'k' does not exist"."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = str(e)
    found = re.match(r"Could not delete from config\. '([^'@]+)' does not exist", text)
    if found is None and isinstance(e.__cause__, (ConfigAttributeError, ConfigKeyError)):
        found = re.match(r"Could not override '([^'@]+)'", text)
    return found.group(1) if found else None


def _unknown_key_message(key: str, cfg: DictConfig) -> str:
    """``a.b.c is not a key of a.b; did you mean a.b.d? (valid: ...)``, at the first part that is missing."""
    parts, node = key.split("."), cfg
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        if not isinstance(node, DictConfig):
            return f"{key}: {parent} is a value, not a group of keys"
        keys = [str(k) for k in node if not re.fullmatch(r"_\w+_", str(k))  # not _target_ and the like
                and (i or k != "hydra" or parts[0] == "hydra")]
        if part not in node.keys():  # noqa: SIM118 - a DictConfig's `in` says False for a ??? key
            return (f"{'.'.join(parts[:i + 1])} is not a key of {parent or 'the config'}"
                    + did_you_mean(part, keys, f"{parent}." if parent else ""))
        leaf = OmegaConf.is_interpolation(node, part) or OmegaConf.is_missing(node, part)
        node = None if leaf else node[part]  # never resolved: ${unique_dir:...} would claim a run directory
    return f"{key} is not a key of the config"


def _unknown_option(e, overrides: list[str], loader) -> str | None:
    """``model=vit_b61 is not an option of model; did you mean model=vit_b16? (valid: ...)`` when the
    missing config is one the command line chose (not one a config file's defaults name)."""
    group, _, option = str(getattr(e, "missing_cfg_file", "") or "").rpartition("/")
    chosen = [o for o in overrides if re.fullmatch(rf"\+{{0,2}}{re.escape(group)}={re.escape(option)}", o)]
    if not group or not chosen:
        return None
    options = list(getattr(e, "options", None) or loader.get_group_options(group))
    return f"{group}={option} is not an option of {group}" + did_you_mean(option, options, f"{group}=")


def say_once(line: str) -> None:
    """Print a line every process of a launch would print alike (a configuration mistake) once per
    machine: under torchrun or ``srun`` only local rank 0 prints it, so four ranks' writes cannot
    interleave into one garbled line; the others exit with the same status, silently."""
    if int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) or 0) == 0:
        print(line, file=sys.stderr, flush=True)


def run_cli(fn, cfg):
    # imported here, not with this module: a command line is checked (command_line_mistake) before torch
    # and Lightning load, and the command's body has loaded them by the time these can be raised
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from vitpipe.lit.classifier import NonFiniteLossError
    from vitpipe.lit.preemption.signals import SecondInterrupt

    clean_run_dir(cfg)
    try:
        return fn(cfg)
    except (ConfigError, MissingMandatoryValue, InterpolationResolutionError) as e:
        say_once(f"vitpipe: error: {e}")
        sys.exit(EXIT_CONFIG)
    except NonFiniteLossError as e:
        print(f"vitpipe: stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_NONFINITE)
    except SIGTERMException as e:
        print(stop_message(e), file=sys.stderr)
        requeue = getattr(e, "vitpipe_requeue", None)
        if requeue is not None:  # submitit's deferred handler (PreemptionCheckpoint): requeue, then exit
            requeue()
        sys.exit(128 + getattr(e, "vitpipe_signal", signal.SIGTERM))  # what a job killed by it reports
    except (KeyboardInterrupt, SecondInterrupt) as e:  # Ctrl-C outside a Trainer stage, or pressed twice
        why = " (pressed twice: stopped at once)" if isinstance(e, SecondInterrupt) else ""
        print(f"vitpipe: interrupted by SIGINT{why}; nothing was saved by the interrupt", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:
        full = disk_full_cause(e)
        if full is None:
            raise
        print(f"vitpipe: error: {disk_full_message(full)}", file=sys.stderr)
        sys.exit(EXIT_DISK_FULL)


def clean_run_dir(cfg) -> None:
    """What our killed writers left in this command's run directory (a killed eval's
    ``.predictions.csv.tmp-*``, a report figure's), removed at the start of every command: Lightning's
    fit start cleans only the checkpoint folders, and eval, predict, visualize, export never fit."""
    try:
        out = OmegaConf.select(cfg, "paths.output_dir", default=None, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - no Hydra run (a test's config): nothing of ours to clean
        return
    if out:
        remove_stale_temps_below(out)


def stop_message(e) -> str:
    """The line of a run stopped by Lightning's SIGTERMException ``e`` (a signal we handle)."""
    name = signal.Signals(getattr(e, "vitpipe_signal", signal.SIGTERM)).name
    saved = getattr(e, "vitpipe_checkpoint", None)
    if saved and getattr(e, "vitpipe_requeue", None) is not None:
        return (f"vitpipe: stopped by {name} at global step {e.vitpipe_step}; saved {saved}: the requeued job "
                "continues from it (ckpt_path=auto)")
    if saved:
        return (f"vitpipe: stopped by {name} at global step {e.vitpipe_step}; saved {saved}: "
                f"rerun with ckpt_path=last (or ckpt_path={saved}) to continue")
    stage = getattr(e, "vitpipe_stage", None)
    return f"vitpipe: stopped by {name}{f' during {stage}' if stage else ''}; no checkpoint was written by the stop"


def disk_full_message(e: OSError) -> str:
    """The file a full disk stopped, what is left, and what to do: a resume only where a checkpoint is saved."""
    where = e.filename or "a file"
    if not isinstance(e, DiskFullError):
        return f"{e.strerror} writing {where}: free space, then rerun the command"
    # our atomic writer: the partial file is gone, the old one untouched
    path = Path(where)
    if path.suffix != ".ckpt":
        return (f"{e.strerror} writing {where}; the partial file was removed and what was there before is "
                "untouched: free space, then rerun the command")
    from vitpipe.run.paths import run_dir_of

    saved = sorted(p.name for p in path.parent.glob("*.ckpt")) if path.parent.is_dir() else []
    if not saved:
        return (f"{e.strerror} writing {where} (the partial file was removed); no checkpoint had been saved, so "
                "there is nothing to resume: free space, then rerun the command")
    return (f"{e.strerror} writing {where}; earlier checkpoints are intact (the partial file was removed; "
            f"{path.parent} holds {', '.join(saved)}): free space, then rerun with ckpt_path={run_dir_of(path)} "
            "to resume")

"""vitpipe.run.checkpoint: which file ckpt_path means, reading files as data, rebuilding a run safely.

One tiny checkpoint is trained once per session (lr_scaling factor 2, an EMA); hostile and broken
variants are written from it. Everything runs in-process except the one CLI test."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_cfg
from hydra.utils import get_method
from omegaconf import OmegaConf

from vitpipe.errors import ConfigError
from vitpipe.run.checkpoint import Rebuilt, rebuild
from vitpipe.run.paths import resolve_ckpt_path
from vitpipe.run.stored import ALLOWED_TARGETS, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BATCH, BASE = 16, 8  # debug=fast's batch; lr_scaling base: linear factor 2


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(run dir, best checkpoint path, its dict, train metrics, the unscaled lr)."""
    from vitpipe.tasks.train import train

    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = make_cfg(tmp, ["debug=fast", "logger=none", "trainer.limit_test_batches=null", "module.ema_decay=0.5",
                         "lr_scaling.rule=linear", f"lr_scaling.base_batch_size={BASE}"])
    lr = cfg.module.optimizer.lr
    metrics = train(cfg)
    run = Path(cfg.paths.output_dir)
    best = next((run / "checkpoints").glob("epoch_*.ckpt"))
    return run, best, torch.load(best, weights_only=True), metrics, lr


def _write(tmp_path: Path, ckpt: dict, name: str = "edited.ckpt", **sections) -> Path:
    ckpt = copy.deepcopy(ckpt)
    ckpt["vitpipe_config"].update(sections)
    path = tmp_path / name
    torch.save(ckpt, path)
    return path


def _eval_cfg(tmp_path: Path, ckpt, *overrides: str):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", "trainer.accelerator=cpu", *overrides], config_name="eval")


# ---------------------------------------------------------------- what train stores


def test_stored_config_equals_config_yaml_after_lr_scaling(trained):
    run, best, ckpt, _, lr = trained
    on_disk = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    for stored in (ckpt["vitpipe_config"], torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
                   ["vitpipe_config"]):
        assert stored == on_disk
        assert stored["module"]["optimizer"]["lr"] == pytest.approx(lr * BATCH / BASE)  # scaled, factor 2
    assert ckpt["class_names"] == [str(d) for d in range(10)]  # digits' label names travel with the weights


# ---------------------------------------------------------------- which file


def test_resolver_file_run_dir_last_and_missing(trained, tmp_path):
    run, best, *_ = trained
    last = run / "checkpoints" / "last.ckpt"
    assert resolve_ckpt_path(str(best)) == best  # a file: itself, whatever `which`
    assert resolve_ckpt_path(best, which="last") == best
    assert resolve_ckpt_path(run) == best  # a run dir: its best checkpoint for eval/visualize/predict/export
    assert resolve_ckpt_path(run, which="last") == last  # ... and its newest state for resume
    logs = run.parent  # holds this run only: `last` is its newest run
    assert resolve_ckpt_path("last", log_dir=logs, which="last") == last
    assert resolve_ckpt_path("last", log_dir=logs) == best
    for value, message in ((tmp_path / "missing.ckpt", r"missing.ckpt: no such file or directory; pass a .ckpt"),
                           (tmp_path, r"that directory holds no .ckpt file"), ("", r"ckpt_path is not set")):
        with pytest.raises(ConfigError, match=message):
            resolve_ckpt_path(value)
    with pytest.raises(ConfigError, match=r"ckpt_path=last: no checkpoint under"):
        resolve_ckpt_path("last", log_dir=tmp_path)


def test_resolver_newest_run_and_recorded_best(tmp_path):
    """Several runs: the newest one. save_top_k=2: the best ModelCheckpoint recorded, not the newest file."""
    old, new = tmp_path / "runs" / "a" / "checkpoints", tmp_path / "runs" / "b" / "checkpoints"
    for folder in (old, new):
        folder.mkdir(parents=True)
    state = {"ModelCheckpoint{'monitor': 'val/acc'}": {"best_model_path": "/moved/away/epoch_000.ckpt"}}
    files = [(old / "last.ckpt", {}, 100), (new / "epoch_000.ckpt", {}, 200), (new / "epoch_001.ckpt", {}, 300),
             (new / "last.ckpt", {"callbacks": state}, 400)]
    for path, extra, mtime in files:
        torch.save({"state_dict": {}, **extra}, path)
        os.utime(path, (mtime, mtime))
    assert resolve_ckpt_path(tmp_path / "runs", which="last") == new / "last.ckpt"
    assert resolve_ckpt_path("last", log_dir=tmp_path) == new / "epoch_000.ckpt"  # recorded best, by name


def _run_folder(tmp_path: Path, files: dict[str, str | None | bytes]) -> Path:
    """<tmp>/run/checkpoints with one file per entry, in this order of mtime: name -> the best_model_path
    its ModelCheckpoint state records (None: no callback state; bytes: the raw file, unreadable)."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for i, (name, best) in enumerate(files.items()):
        if isinstance(best, bytes):
            (folder / name).write_bytes(best)
        else:
            state = {} if best is None else {"callbacks": {"BestAndLastCheckpoint{'monitor': 'val/acc'}":
                                                           {"best_model_path": best}}}
            torch.save({"state_dict": {}, **state}, folder / name)
        os.utime(folder / name, (100 + i, 100 + i))
    return folder


def test_best_is_what_the_run_recorded_even_without_last_ckpt(tmp_path):
    # save_last=false, save_top_k=2: the newest checkpoint's ModelCheckpoint state names the best
    folder = _run_folder(tmp_path, {"epoch_000.ckpt": "/r/epoch_000.ckpt", "epoch_001.ckpt": "/r/epoch_000.ckpt"})
    assert resolve_ckpt_path(folder.parent) == folder / "epoch_000.ckpt"


@pytest.mark.parametrize("files, message", [
    ({"epoch_002.ckpt": "", "epoch_003.ckpt": "", "last.ckpt": "/r/checkpoints/epoch_001.ckpt"},
     r"ckpt_path=\S+/run: the run records /r/checkpoints/epoch_001.ckpt as its best checkpoint, but \S+/checkpoints "
     r"has no epoch_001.ckpt \(it holds epoch_002.ckpt, epoch_003.ckpt, last.ckpt\); pass ckpt_path=<one of those "
     r"files>"),
    ({"epoch_003.ckpt": "", "last.ckpt": "/r/checkpoints/epoch_001.ckpt"},  # the best deleted to save space
     r"records /r/checkpoints/epoch_001.ckpt as its best checkpoint, but .* has no epoch_001.ckpt"),
    ({"epoch_002.ckpt": "", "epoch_003.ckpt": "", "last.ckpt": b"PK\x03\x04 cut short"},
     r"ckpt_path=\S+/run: cannot tell which of 2 checkpoints is the best: last.ckpt, which records it, cannot be "
     r"read: the file is truncated or corrupt \(it was probably cut short while being written or copied\); "
     r"pass ckpt_path=<one of epoch_002.ckpt, epoch_003.ckpt, last.ckpt>$"),
    ({"a.ckpt": None, "b.ckpt": None},
     r"cannot tell which of 2 checkpoints is the best: none records it \(no ModelCheckpoint state\); "
     r"pass ckpt_path=<one of a.ckpt, b.ckpt>"),
], ids=["recorded-best-missing", "only-another-left", "last-unreadable", "no-record"])
def test_best_that_cannot_be_found_is_refused_in_one_line(tmp_path, files, message):
    """Eval, predict, export and visualize on a run directory use its best checkpoint, the one the
    run's own test used; another file in its place would report numbers the run never had."""
    folder = _run_folder(tmp_path, files)
    with pytest.raises(ConfigError, match=message) as e:
        resolve_ckpt_path(folder.parent)
    assert "\n" not in str(e.value)
    assert resolve_ckpt_path(folder.parent, which="last") == folder / sorted(files)[-1]  # resume is not affected


def test_best_without_a_record_is_the_only_candidate(tmp_path):
    # no best recorded yet (stopped before the first validation): last.ckpt is all there is
    folder = _run_folder(tmp_path, {"last.ckpt": ""})
    assert resolve_ckpt_path(folder.parent) == folder / "last.ckpt"
    lone = _run_folder(tmp_path / "lone", {"epoch_004.ckpt": None})
    assert resolve_ckpt_path(lone.parent) == lone / "epoch_004.ckpt"
    # a folder holding one checkpoint copied from elsewhere and renamed: that one, whatever it records
    renamed = _run_folder(tmp_path / "renamed", {"model.ckpt": "/other/machine/checkpoints/epoch_003.ckpt"})
    assert resolve_ckpt_path(renamed.parent) == renamed / "model.ckpt"


# ---------------------------------------------------------------- reading


def _pickled_payload(path: Path, marker: Path) -> None:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state_dict": {}, "payload": Payload()}, path)


def test_unreadable_files_one_complete_sentence(trained, tmp_path):
    _, best, *_ = trained
    marker = tmp_path / "marker"
    text, truncated, pickled, empty = (tmp_path / n for n in ("text.ckpt", "trunc.ckpt", "pickled.ckpt", "empty.ckpt"))
    text.write_text("epoch: 3\nthis is a text file\n")
    truncated.write_bytes(best.read_bytes()[: best.stat().st_size // 2])
    _pickled_payload(pickled, marker)
    empty.write_bytes(b"")
    cases = {text: "is not a PyTorch checkpoint", truncated: "is truncated or corrupt",
             pickled: "pickled Python object (posix.system)", empty: "the file is empty"}
    for path, words in cases.items():
        with pytest.raises(ConfigError) as err:
            load_checkpoint(path)
        message = str(err.value)
        assert message.startswith(f"cannot read checkpoint {path}: ") and words in message, message
        assert "\n" not in message and message.endswith(".") and "two options" not in message, message
    assert not marker.exists()  # the payload's code never ran


def test_eval_cli_text_file_is_one_line(tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("hello\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "eval.py"), f"ckpt_path={text}",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) <= 3 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[-1] == f"vitpipe: error: cannot read checkpoint {text}: it is not a PyTorch checkpoint " \
                        "(torch.save writes a zip archive); pass a .ckpt written by scripts/train.py."


# ---------------------------------------------------------------- hostile stored configs


def _hostile(ckpt: dict, marker: Path) -> dict[str, tuple[dict, str]]:
    """name -> (sections to replace, the key the refusal must name)."""
    config = ckpt["vitpipe_config"]
    opener = {"_target_": "builtins.open", "file": str(marker), "mode": "w"}
    module = copy.deepcopy(config["module"])
    module["optimizer"] = dict(opener)  # no _partial_: instantiate would call it
    data = copy.deepcopy(config["data"])
    data["_target_"] = "hydra.utils.get_method"
    model = copy.deepcopy(config["model"])
    model["pos_embed"] = "${oc.decode:'{_target_: builtins.open, file: " + str(marker) + ", mode: w}'}"
    args = copy.deepcopy(config["model"])
    args["_args_"] = [opener]
    return {
        "model": ({"model": opener}, "model._target_='builtins.open'"),
        "nested optimizer": ({"module": module}, "module.optimizer._target_='builtins.open'"),
        "generic importer": ({"data": data}, "data._target_='hydra.utils.get_method'"),
        "interpolation": ({"model": model}, "interpolation at model.pos_embed"),
        "_args_": ({"model": args}, "Hydra key model._args_"),
    }


@pytest.mark.parametrize("variant", ["model", "nested optimizer", "generic importer", "interpolation", "_args_"])
def test_hostile_stored_config_is_refused_by_every_loader(trained, tmp_path, variant):
    from vitpipe.tasks.evaluate import evaluate
    from vitpipe.tasks.visualize import visualize

    _, _, ckpt, *_ = trained
    marker = tmp_path / "marker"
    sections, named = _hostile(ckpt, marker)[variant]
    path = _write(tmp_path, ckpt, **sections)
    loaders = {
        "eval": lambda: evaluate(_eval_cfg(tmp_path / "eval", path)),
        "visualize": lambda: visualize(make_cfg(tmp_path / "viz", [f"ckpt_path={path}", "images=test"],
                                                config_name="visualize")),
        "rebuild": lambda: rebuild(load_checkpoint(path), path),
    }
    for name, load in loaders.items():
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert message.startswith(f"refused checkpoint {path}: ") and named in message, (name, message)
        assert "\n" not in message
    assert not marker.exists()


# ---------------------------------------------------------------- eval


def test_eval_reads_once_ignores_the_files_paths_and_reproduces_the_test(trained, tmp_path, monkeypatch):
    """The stored config points output, logs, checkpoints and data elsewhere: eval writes only under its
    own run dir, reads the checkpoint once, and scores what training's own test scored."""
    from vitpipe.tasks.evaluate import evaluate

    _, _, ckpt, metrics, _ = trained
    elsewhere = tmp_path / "elsewhere"
    config = ckpt["vitpipe_config"]
    path = _write(tmp_path, ckpt,
                  paths={**config["paths"], "output_dir": str(elsewhere / "out"), "log_dir": str(elsewhere / "logs"),
                         "data_dir": str(elsewhere / "data")},
                  logger={"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": str(elsewhere)}},
                  trainer={**config["trainer"], "default_root_dir": str(elsewhere / "trainer")},
                  callbacks={"ckpt": {"_target_": "lightning.pytorch.callbacks.ModelCheckpoint",
                                      "dirpath": str(elsewhere / "ckpts")}},
                  hydra={"run": {"dir": str(elsewhere / "hydra")}})
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(a[0]) or real_load(*a, **kw))
    ecfg = _eval_cfg(tmp_path / "eval", path)
    scores = evaluate(ecfg)
    assert loads == [path]
    assert scores["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)  # the EMA weights, as train tested
    assert not elsewhere.exists()
    out = Path(ecfg.paths.output_dir)
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert set(written) == {"task_name", "model", "data", "module", "paths"}
    assert written["paths"]["output_dir"] == str(out) and (out / "metrics.json").is_file()


def test_eval_with_other_data_names_the_class_counts(trained, tmp_path):
    from vitpipe.tasks.evaluate import evaluate

    _, best, *_ = trained
    with pytest.raises(ConfigError) as err:
        evaluate(_eval_cfg(tmp_path, best, "data=cifar100"))
    assert str(err.value) == (f"checkpoint {best} has 10 classes, data=cifar100 has 100; use data with the same "
                              "10 classes, or leave data out to use the checkpoint's own")


# ---------------------------------------------------------------- rebuild (predict / export use it)


def test_rebuild_returns_the_evaluated_network_and_names(trained, tmp_path):
    _, best, ckpt, *_ = trained
    paths = OmegaConf.create({"root_dir": str(tmp_path), "data_dir": str(tmp_path / "d"), "log_dir": str(tmp_path),
                              "output_dir": str(tmp_path / "o")})
    run = rebuild(load_checkpoint(best), best, paths=paths, task_name="predict")
    assert isinstance(run, Rebuilt) and run.class_names == [str(d) for d in range(10)]
    assert not run.net.training and not run.module.training
    state = ckpt["state_dict"]
    own = run.net.state_dict()
    assert all(torch.equal(v, state[f"ema.module.{k}"]) for k, v in own.items())  # the EMA the run tested with
    assert any(not torch.equal(v, state[f"net.{k}"]) for k, v in own.items())  # which differs from the raw net
    assert all(torch.equal(v, state[k]) for k, v in run.module.state_dict().items())
    assert run.cfg.task_name == "predict" and run.cfg.paths.data_dir == str(tmp_path / "d")
    assert "trainer" not in run.cfg and "logger" not in run.cfg and "callbacks" not in run.cfg
    assert type(run.datamodule).__name__ == "DigitsDataModule"


def test_rebuild_moves_data_roots_under_the_current_data_dir(trained, tmp_path):
    """A stored data root is never used as is: under the old data_dir it keeps its relative part."""
    _, _, ckpt, *_ = trained
    old = ckpt["vitpipe_config"]["paths"]["data_dir"]
    paths = OmegaConf.create({"data_dir": str(tmp_path / "data")})
    fmnist = {"_target_": "vitpipe.data.FashionMNISTDataModule", "num_classes": 10, "channels": 1, "img_size": 8,
              "in_chans": 1}
    for root, expect in ((f"{old}/fmnist", tmp_path / "data" / "fmnist"), ("/etc", tmp_path / "data"),
                         (f"{old}/../../etc", tmp_path / "data")):
        path = _write(tmp_path, ckpt, data={**fmnist, "root": root})
        run = rebuild(load_checkpoint(path), path, paths=paths)
        assert run.cfg.data.root == str(expect), root
    # a path outside the stored root is never followed: its name alone, under the current root
    # (vitpipe.run.stored: training accepted it, so the checkpoint loads; refusing it broke every later command)
    path = _write(tmp_path, ckpt, data={**fmnist, "root": old, "splits": {"test": {"captions": "/etc/passwd"}}})
    run = rebuild(load_checkpoint(path), path, paths=paths)
    assert run.cfg.data.splits.test.captions == "passwd"


def test_allow_list_covers_conf_and_holds_no_importer():
    """Every _target_ the model, data and module groups (and experiments' deltas) use is allowed in
    its section; every allowed name resolves to a callable; no generic importer is on the list."""
    used: dict[str, set[str]] = {"model": set(), "data": set(), "module": set()}

    def targets(node):
        if isinstance(node, dict):
            yield from ([node["_target_"]] if "_target_" in node else [])
            for v in node.values():
                yield from targets(v)
        elif isinstance(node, list):
            for v in node:
                yield from targets(v)

    for section in used:
        for f in (ROOT / "conf" / section).glob("*.yaml"):
            node = yaml.safe_load(f.read_text()) or {}
            if f.read_text().startswith("# @package _global_"):  # e.g. module=mae: its section is its `module:` key
                node = node.get(section) or {}
            used[section] |= set(targets(node))
    for f in [*(ROOT / "conf" / "experiment").glob("*.yaml"), *(ROOT / "conf" / "recipe").glob("*.yaml")]:
        delta = yaml.safe_load(f.read_text()) or {}
        for section in used:
            used[section] |= set(targets(delta.get(section) or {}))
    for section, names in used.items():
        assert names and names <= ALLOWED_TARGETS[section], (section, names - ALLOWED_TARGETS[section])
    every = set().union(*ALLOWED_TARGETS.values())
    assert not any(n.startswith(("builtins.", "hydra.", "lightning.pytorch.cli", "os.", "subprocess.")) for n in every)
    assert all(callable(get_method(n)) for n in every)

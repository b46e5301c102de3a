"""Config mistakes stop before any data loads, with one line naming the key; every model argument
can be overridden without `+`; the shipped configs pass the same checks."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning
import pytest
import torch
from omegaconf import OmegaConf, open_dict
from test_scale import _train_cli

from vitpipe.config.preflight import check_config
from vitpipe.errors import ConfigError
from vitpipe.models.registry import VARIANTS
from vitpipe.models.vit import ViT
from vitpipe.tasks.cli import run_cli

MISTAKES = [  # (override, what the one line must say)
    ("module.optimizer.lr=-1", "module.optimizer.lr=-1 must be a number > 0"),
    ("module.optimizer.lr=0", "module.optimizer.lr=0 must be a number > 0"),
    ("data.batch_size=abc", "data.batch_size='abc' must be a positive integer"),  # the command line's wording
    ("data.batch_size=0", "data.batch_size=0 must be a positive integer"),
    ("data.eval_batch_size=-4", "data.eval_batch_size=-4"),
    ("trainer.max_epochs=abc", "trainer.max_epochs='abc' must be an integer >= 1"),
    ("trainer.max_epochs=-5", "trainer.max_epochs=-5"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0"),
    ("lr_scaling.base_batch_size=0", "lr_scaling.base_batch_size=0"),
    ("module.optimizer.betas=[1.5,0.9]", "module.optimizer: ValueError: Invalid beta parameter at index 0: 1.5"),
    ("+module.optimizer.momentum=0.9", "module.optimizer.momentum is not an argument of AdamW"),
    ("+model.dpeth=3", "model.dpeth is not an argument of create_model"),
    ("model.depth=6.5", "model.depth=6.5: create_model expects depth: int"),
    ("module.label_smoothing=1.5", "module.label_smoothing=1.5"),
    ("data.img_size=${model.nope}", "data.img_size: Interpolation key 'model.nope' not found"),
]


@pytest.mark.parametrize("override, message", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_config_mistake_is_one_line_naming_the_key_before_data_loads(cfg_factory, capsys, monkeypatch,
                                                                       override, message):
    import vitpipe.tasks.train

    def no_build(*a, **k):
        raise AssertionError("the data and model were built before the mistake was reported")

    monkeypatch.setattr(vitpipe.tasks.train, "build_from_config", no_build)
    cfg = cfg_factory("debug=fast", "logger=none", override)
    with pytest.raises(SystemExit) as stop:
        run_cli(vitpipe.tasks.train.train, cfg)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) <= 3 and lines[-1].startswith(f"vitpipe: error: {message}"), lines


def test_a_target_that_does_not_exist_is_one_line(cfg_factory, capsys):
    from vitpipe.tasks.train import train

    cfg = cfg_factory("debug=fast", "logger=none", "model._target_=vitpipe.nope")
    with pytest.raises(SystemExit) as stop:
        run_cli(train, cfg)
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "vitpipe: error: model._target_='vitpipe.nope' cannot be imported")


def test_config_mistake_through_the_real_cli_prints_at_most_three_lines(tmp_path):
    """The whole stderr of the real command (Hydra and Lightning included); the other mistakes go
    through the same run_cli in-process above."""
    r = _train_cli("debug=fast", "logger=none", "data.batch_size=abc", f"hydra.run.dir={tmp_path}", timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) <= 3, lines
    assert lines[-1] == "vitpipe: error: data.batch_size='abc' must be a positive integer"


def _non_default(name: str, default):
    """A valid value other than the ViT default for each argument."""
    special = {"pos_embed": "rope2d", "stem": "conv", "pool": "mean", "class_token": False, "reg_tokens": 2,
               "init_values": 1e-5, "img_size": 16, "patch_size": 4, "in_chans": 3, "num_classes": 10,
               "dim": 48, "depth": 6, "num_heads": 3, "mlp_ratio": 2.0, "flexi_patch_sizes": [2, 4],
               "rel_pos": "mlp_swin", "rel_pos_dim": 64, "fc_norm": False, "attn_window": 2, "attn_global_stride": 2,
               "attn_backend": "sdpa", "pool_num_heads": 2, "pool_mlp_ratio": 2.0, "rope_ref_grid": [4, 4]}
    if name in special:
        return special[name]
    if isinstance(default, bool):
        return not default
    return 0.1 if isinstance(default, float) else default


VIT_ARGS = {n: p.default for n, p in inspect.signature(ViT).parameters.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_vit_argument_is_overridable_without_plus(cfg_factory, variant):
    """`model.depth=6`-style overrides compose for every ViT argument (the README's examples
    included), and each model config resolves to its variant's dimensions exactly."""
    overrides = {n: _non_default(n, d) for n, d in VIT_ARGS.items()}
    args = [f"model.{n}={v if not isinstance(v, bool) else str(v).lower()}" for n, v in overrides.items()]
    cfg = cfg_factory(f"model={variant}", *args)  # raises "not in struct" for a missing key
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert set(VIT_ARGS) <= set(model), set(VIT_ARGS) - set(model)
    assert {n: model[n] for n in overrides} == overrides
    check_config(cfg)  # the values fit ViT's signature

    plain = OmegaConf.to_container(cfg_factory(f"model={variant}", sub="plain").model, resolve=True)
    assert {k: plain[k] for k in VARIANTS[variant]} == VARIANTS[variant]  # the registry's dimensions


def test_every_variant_has_its_model_option_and_no_more():
    """The one thing left to keep in step: Hydra needs a file per option, so each VARIANTS key has
    its conf/model/<name>.yaml (two lines: `defaults: [vit]`, its name) and no vit_* file names a
    variant the table lacks; the dimensions themselves are read from the table (conf/model/vit.yaml)."""
    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    files = {f.stem: OmegaConf.load(f) for f in conf.glob("vit_*.yaml")}
    assert set(files) == set(VARIANTS)
    for name, node in files.items():
        assert list(node.defaults) == ["vit"] and node.name == name, name
        assert not set(node) & set(VARIANTS[name]), f"{name}.yaml restates the table's {set(node) & set(VARIANTS[name])}"


def test_readme_model_override_builds_what_it_says(cfg_factory):
    from hydra.utils import instantiate

    cfg = cfg_factory("model.pos_embed=sincos2d", "model.depth=6", "model.qk_norm=true", "model.reg_tokens=2",
                      "model.mlp_ratio=2")
    net = instantiate(cfg.model)
    assert len(net.blocks) == 6 and net.num_prefix_tokens == 3 and net.blocks[0].mlp.fc1.out_features == 2 * net.dim
    assert type(net.pos_embed).__name__ == "SinCos2DPosEmbed" and isinstance(net.blocks[0].attn.q_norm, torch.nn.LayerNorm)


SHIPPED = [  # together these use every option of the groups a run composes
    ["model=vit_b16", "data=cifar10", "trainer=ddp", "logger=[csv,tensorboard,wandb]", "callbacks=rollout",
     "module.ema_decay=0.999", "+module.mixup={mixup_alpha: 0.8, cutmix_alpha: 1.0}"],
    ["experiment=caption_shapes", "trainer=ddp_cpu", "debug=fast"],
    ["experiment=caption_shapes", "data=coco_captions", "trainer=gpu"],
    ["experiment=fmnist_vit", "trainer=fsdp", "model=vit_h14"],
    ["experiment=cifar10_vit", "data=cifar100", "hparams_search=optuna", "logger=none"],
    ["model=vit_ti16", "data=imagefolder", "data.num_classes=3", "data.root=/x", "trainer=cpu", "debug=default"],
    ["model=vit_micro", "data=synthetic", "lr_scaling.rule=sqrt"],
]


@pytest.mark.parametrize("overrides", SHIPPED, ids=[" ".join(o[:2]) for o in SHIPPED])
def test_shipped_configs_pass_the_checks(cfg_factory, overrides):
    check_config(cfg_factory(*overrides))


def test_checks_never_import_a_target_outside_the_trusted_libraries(cfg_factory):
    """A stored config may name any callable: the checks read signatures only of vitpipe, torch,
    timm and lightning, and import nothing else (instantiate runs after the loaders' own checks)."""
    import sys

    from vitpipe.config.checks import check_arguments

    cfg = cfg_factory("debug=fast")
    with open_dict(cfg):
        cfg.callbacks.evil = {"_target_": "tabnanny.check", "file": "/nonexistent"}
    assert "tabnanny" not in sys.modules
    check_arguments(cfg)  # nothing to judge about a target it does not read
    assert "tabnanny" not in sys.modules


# ---- override mistakes Hydra itself would report (before any vitpipe code ran) -----------------

SCRIPTS = ["train", "eval", "predict", "export", "visualize_attention", "make_shards"]


def _vitpipe_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vitpipe:")]


def test_unknown_key_through_the_real_cli_is_one_line_with_the_close_match(tmp_path):
    r = _train_cli("trainer.max_epoch=3", f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == _vitpipe_lines(r.stderr), r.stderr[-2000:]  # nothing but the line
    (line,) = _vitpipe_lines(r.stderr)
    assert line.startswith("vitpipe: error: trainer.max_epoch is not a key of trainer; "
                           "did you mean trainer.max_epochs? (valid: "), line
    assert "max_steps" in line and len(line) < 300, line
    assert not (tmp_path / "run").exists()  # stopped before Hydra made the run directory


EARLY = [  # (command, its command line, the start of its one line): each answered before torch loads
    ("train", ["trainer.max_epoch=3"], "trainer.max_epoch is not a key of trainer; did you mean"),
    ("train", ["data.batch_size=abc"], "data.batch_size='abc' must be a positive integer"),
    # a plain value beside the model's ${variant:...} values, which the check leaves unresolved
    ("train", ["model=vit_s16", "model.drop_path_rate=2"], "model.drop_path_rate=2 must be in [0, 1)"),
    ("train", ["-m", "trainer.time_budget=soon,30min"], "trainer.time_budget='soon': expected a duration"),
    # configs that merge a value over an interpolation (debug=fast's precision over ${auto_precision:}, an
    # experiment's model values over ${variant:...}): OmegaConf's merge dereferences what it merges over
    ("train", ["debug=fast", "logger=none", "data.batch_size=abc"], "data.batch_size='abc' must be a positive integer"),
    ("train", ["experiment=fmnist_vit", "seed=-5"], "seed=-5 must be an integer in [0, 4294967295]"),
    # a rule across keys, both written plainly: the README's example (data.num_classes is digits' 10)
    ("train", ["model.num_classes=7"], "model.num_classes=7 does not match data.num_classes=10; drop the"),
    ("eval", ["ckpt_path=last", "seed=abc"], "seed='abc' must be an integer in [0, 4294967295]"),
    ("doctor", ["model=vit_micro", "model.drop_rate=3"], "model.drop_rate=3 must be in [0, 1)"),
]


@pytest.mark.parametrize(("command", "args", "message"), EARLY, ids=[" ".join(a) for _, a, _ in EARLY])
def test_a_command_line_mistake_is_printed_before_torch_loads(tmp_path, command, args, message):
    """The command line is checked on Hydra and OmegaConf alone: importing vitpipe and composing the config
    loads neither torch, Lightning nor timm (11 s of imports on a slow CPU), so a mistyped key or a value of
    the wrong type or range is its one line in about a second (a multirun's first job's); the command's body
    is imported only once the line has passed."""
    import subprocess
    import sys

    code = (f"import sys\nfrom vitpipe.commands import run\ntry:\n    run({command!r}, {args!r})\n"
            "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'lightning', 'timm') "
            "if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "exit 2 []", (r.stdout, r.stderr[-2000:])
    (line,) = _vitpipe_lines(r.stderr)
    assert line.startswith(f"vitpipe: error: {message}"), line
    assert list(tmp_path.iterdir()) == []  # no run directory, no outputs folder


HANDED = [  # (command, its command line with {d} for a folder of handed files, its one line with {d})
    ("eval", ["ckpt_path={d}/notes.ckpt"], "cannot read checkpoint {d}/notes.ckpt: it is not a PyTorch checkpoint "
     "(torch.save writes a zip archive); pass a .ckpt written by scripts/train.py."),
    ("export", ["ckpt_path={d}/empty.ckpt", "format=onnx", "out={d}/m.onnx"],
     "cannot read checkpoint {d}/empty.ckpt: the file is empty."),
    # predict's out= first, as its body checks it before it reads the checkpoint
    ("predict", ["ckpt_path={d}/notes.ckpt", "images={d}", "out={d}/notes.ckpt/p.csv"],
     "out={d}/notes.ckpt/p.csv: {d}/notes.ckpt is a file, not a folder; pass out=<a writable folder>/<name>.csv or "
     ".json"),
]


@pytest.mark.parametrize(("command", "args", "message"), HANDED, ids=[c for c, _, _ in HANDED])
def test_a_handed_file_refused_by_its_first_bytes_is_its_line_before_torch_loads(tmp_path, command, args, message):
    """A ``ckpt_path=`` file that is empty or a text file, and predict's ``out=`` under a file, are the command's
    own one line (the body words them the same way: test_checkpoint, test_predict), answered before torch."""
    import subprocess
    import sys

    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.ckpt").write_text("hello\n")
    (files / "empty.ckpt").write_bytes(b"")
    argv = [a.format(d=files) for a in args]
    code = (f"import sys\nfrom vitpipe.commands import run\ntry:\n    run({command!r}, {argv!r})\n"
            "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'lightning', 'timm') "
            "if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "exit 2 []", (r.stdout, r.stderr[-2000:])
    assert _vitpipe_lines(r.stderr) == [f"vitpipe: error: {message.format(d=files)}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files"]  # no run directory, no outputs folder


@pytest.mark.parametrize("command", ["predict", "train"])
def test_a_zip_bomb_on_the_command_line_is_its_line_before_torch_loads(tmp_path, command):
    """``predict.py ckpt_path=<bomb>`` and ``train.py model.pretrained=<bomb>``: the archive's directory alone
    declares more than its size allows, so the command line's check refuses it with the readers' own line
    (``safeload.check_archive``), before torch loads: nothing inflates, not even torch's imports."""
    import subprocess
    import sys

    from test_checkpoint_seams import make_bomb

    from vitpipe.run.safeload import check_archive

    (tmp_path / "files").mkdir()
    bomb = make_bomb(tmp_path / "files" / "bomb.ckpt", 64 << 20)
    argv, what = ((["ckpt_path=" + str(bomb), f"images={bomb.parent}"], "checkpoint") if command == "predict" else
                  (["debug=fast", "logger=none", f"model.pretrained={bomb}"], "weights file"))
    with pytest.raises(ConfigError) as e:
        check_archive(bomb, what=what)
    code = (f"import sys\nfrom vitpipe.commands import run\ntry:\n    run({command!r}, {argv!r})\n"
            "except SystemExit as e:\n    print('exit', e.code, sorted(m for m in ('torch', 'lightning', 'timm') "
            "if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "exit 2 []", (r.stdout, r.stderr[-2000:])
    assert _vitpipe_lines(r.stderr) == [f"vitpipe: error: {e.value}"] and "declare" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files"]  # no run directory, no outputs folder


def test_a_valid_command_line_is_checked_without_torch(tmp_path):
    """The check of a valid command line resolves nothing (a model's ``${variant:...}`` values would import
    the model code; so would asking ``key in node``) and passes: the run's own preflight checks the resolved
    values."""
    import subprocess
    import sys

    code = ("import sys\nfrom vitpipe.config.shipped import CONF_DIR\nfrom vitpipe.tasks.cli import command_line_mistake\n"
            "for argv in ([], ['model=vit_s16', 'model.drop_path_rate=0.2'], ['-m', 'seed=0,1'], ['debug=fast'],\n"
            "             ['experiment=fmnist_vit'], ['model=vit_b16', 'data=cifar10']):\n"
            "    print(command_line_mistake(CONF_DIR, 'train', argv))\n"
            "print(sorted(m for m in ('torch', 'lightning', 'timm') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["None"] * 6 + ["[]"], (r.stdout, r.stderr[-2000:])


def test_unknown_key_in_a_multirun_is_the_same_line_and_no_sweep_starts(tmp_path):
    r = _train_cli("trainer.max_epoch=3,4", f"hydra.sweep.dir={tmp_path}/sweep", multirun=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = _vitpipe_lines(r.stderr)
    assert line.startswith("vitpipe: error: trainer.max_epoch is not a key of trainer; did you mean "
                           "trainer.max_epochs?"), line
    assert not (tmp_path / "sweep").exists()


def _script_main(name: str):
    import importlib.util

    from test_scale import ROOT

    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_reports_an_unknown_key_in_one_line(script, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [f"{script}.py", "task_namex=1"])
    with pytest.raises(SystemExit) as stop:
        _script_main(script)()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "vitpipe: error: task_namex is not a key of the config; did you mean task_name? (valid: "), err


@pytest.mark.parametrize("local_rank, lines", [("0", 1), ("1", 0), ("3", 0)])
def test_a_mistake_under_torchrun_is_printed_by_local_rank_0_only(local_rank, lines, monkeypatch, capsys):
    # four ranks writing the same line at once interleave it into garbage; every rank exits 2
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr("sys.argv", ["train.py", "task_namex=1"])
    with pytest.raises(SystemExit) as stop:
        _script_main("train")()
    assert stop.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == lines


@pytest.mark.parametrize("argv, message", [
    (["model=vit_b61"], "model=vit_b61 is not an option of model; did you mean model=vit_b16? (valid: captioner, "),
    (["-m", "model=vit_nano,vit_b61"], None),  # the first job composes; Hydra reports the later one itself
    (["trainr.max_epochs=3"], "trainr is not a key of the config; did you mean trainer? (valid: "),
    (["~trainer.max_epoch"], "trainer.max_epoch is not a key of trainer; did you mean trainer.max_epochs?"),
    (["hydra.run.dirr=x"], "hydra.run.dirr is not a key of hydra.run; did you mean hydra.run.dir? (valid: dir)"),
    (["debug=fast", "model.dpeth=3"], "model.dpeth is not a key of model; did you mean model.depth? (valid: "),
    # a classifier's search space on an MAE: Hydra would stop at the first trial ("Could not override")
    (["-m", "hparams_search=optuna", "model=mae_vit_nano", "module=mae"],
     ("hparams_search=optuna searches module.label_smoothing, which this config lacks: module.label_smoothing is "
      "not a key of module (valid: ")),
])
def test_override_mistakes_are_one_line(argv, message, monkeypatch, capsys):
    import vitpipe.tasks.cli

    if message is None:
        assert vitpipe.tasks.cli.command_line_mistake(_conf(), "train", argv) is None
        return
    assert vitpipe.tasks.cli.command_line_mistake(_conf(), "train", argv).startswith(message)


def _conf():
    from test_scale import ROOT

    return ROOT / "conf"


def test_valid_command_lines_pass_the_override_check():
    from vitpipe.tasks.cli import command_line_mistake

    for argv in (["debug=fast", "model.depth=2", "+trainer.max_time=null"], ["-m", "model=vit_nano,vit_micro",
                 "model.depth=1,2"], ["-m", "hparams_search=optuna"], ["--cfg", "job"], ["--help"],
                 ["-m", "experiment=mae_fmnist", "hparams_search=optuna_mae"],
                 ["model=vit_b16", "data=cifar10"], ["hydra/launcher=submitit_local"]):
        assert command_line_mistake(_conf(), "train", argv) is None, argv


def test_plus_key_the_target_does_not_take_names_the_close_match(cfg_factory, capsys):
    from vitpipe.tasks.train import train

    cfg = cfg_factory("debug=fast", "logger=none", "+trainer.max_epoch=3")
    with pytest.raises(SystemExit):
        run_cli(train, cfg)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("vitpipe: error: trainer.max_epoch is not an argument of Trainer; did you mean "
                           "trainer.max_epochs? (valid: accelerator, strategy, "), line
    assert len(line) < 300, line


# ---- resuming with another model ------------------------------------------------------------


def _saved_module(tmp_path, *overrides: str):
    from conftest import make_cfg

    from vitpipe.run.build import build_from_config

    _, _, module = build_from_config(make_cfg(tmp_path / "src", ["debug=fast", "logger=none", *overrides]))
    path = tmp_path / "src" / "last.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, path)
    return path


def test_check_fits_names_unexpected_keys_and_shape_mismatches(tmp_path):
    from vitpipe.models.registry import create_model
    from vitpipe.run.stored import check_fits

    deeper = {f"net.{k}": v for k, v in create_model("vit_nano", dim=32, depth=3, num_heads=2).state_dict().items()}
    with pytest.raises(ConfigError) as err:
        check_fits(deeper, create_model("vit_nano", dim=32, depth=1, num_heads=2), "x.ckpt")
    msg = str(err.value)
    assert "24 unexpected keys: blocks.1.norm1.weight, blocks.1.norm1.bias, blocks.1.attn.qkv.weight and 21 more" \
        in msg, msg
    wider = {f"net.{k}": v for k, v in create_model("vit_nano", dim=48, depth=2, num_heads=2).state_dict().items()}
    with pytest.raises(ConfigError) as err:
        check_fits(wider, create_model("vit_nano", dim=32, depth=1, num_heads=2), "x.ckpt")
    msg = str(err.value)
    assert "shape mismatches (checkpoint vs model): cls_token (1,1,48) vs (1,1,32) and " in msg, msg
    assert "12 unexpected keys: blocks.1." in msg and "\n" not in msg and len(msg) < 400, msg
    check_fits(deeper, create_model("vit_nano", dim=32, depth=3, num_heads=2), "x.ckpt")  # fits: no error


def test_resume_with_fewer_blocks_is_one_line_through_the_cli(tmp_path):
    ckpt = _saved_module(tmp_path, "model.depth=2")
    r = _train_cli("debug=fast", "logger=none", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path}/run",
                   f"paths.log_dir={tmp_path}/logs", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = _vitpipe_lines(r.stderr)
    assert line.startswith(f"vitpipe: error: checkpoint {ckpt} does not fit the configured model: "
                           "12 unexpected keys: blocks.1.norm1.weight, "), line
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before the run wrote anything of its own

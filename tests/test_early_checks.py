"""Values that used to be checked only once training ran (or never) are one line before any data loads:
a seed numpy refuses, a mixup setting timm asserts on at the first batch, zero epochs, a NaN or an
infinity that torch's own checks let through (``weight_decay=inf`` stopped the run at step 1)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from user_shell import fresh_checkout, run

from vitpipe.tasks.cli import run_cli

# (override, the one line after "vitpipe: error: ": the value and what would be valid)
FAMILY = [
    ("seed=-5", "seed=-5 must be an integer in [0, 4294967295], or null"),
    ("seed=4294967296", "seed=4294967296 must be an integer in [0, 4294967295]"),
    ("data.seed=-1", "data.seed=-1 must be an integer in [0, 4294967295]"),
    ("+module.mixup.mixup_alpha=-1", "module.mixup.mixup_alpha=-1 must be a finite number >= 0 (0: off)"),
    ("module.mixup={mixup_alpha:0.8,cutmix_alpha:-1}", "module.mixup.cutmix_alpha=-1 must be a finite number >= 0"),
    ("module.mixup={mixup_alpha:0,cutmix_alpha:0}", "module.mixup turns neither on (mixup_alpha=0, cutmix_alpha=0)"),
    ("module.mixup={mixup_alpha:0.8,prob:1.5}", "module.mixup.prob=1.5 must be a probability in [0, 1]"),
    ("module.mixup={mixup_alpha:0.8,switch_prob:-0.1}", "module.mixup.switch_prob=-0.1 must be a probability in [0, 1]"),
    ("module.mixup={mixup_alpha:0.8,mode:batches}", "module.mixup.mode='batches'; valid choices: batch, pair, elem"),
    ("module.mixup={mixup_alpha:0.8,label_smoothing:1.0}", "module.mixup.label_smoothing=1.0 must be in [0, 1)"),
    ("module.mixup={mixup_alpha:nan}", "module.mixup.mixup_alpha=nan must be a finite number >= 0"),
    ("module.mixup={mixup_alfa:0.8}", "module.mixup.mixup_alfa is not a setting of timm's Mixup; did you mean "
                                      "module.mixup.mixup_alpha?"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0 must be an integer >= 1, or -1 (no limit"),
    ("trainer.max_steps=0", "trainer.max_steps=0 must be an integer >= 1, or -1 (no limit)"),
    ("++trainer.limit_train_batches=0", "trainer.limit_train_batches=0 must be an integer >= 1 (batches), a fraction"),
    ("module.optimizer.weight_decay=inf", "module.optimizer.weight_decay=inf must be a finite number >= 0"),
    ("module.optimizer.weight_decay=nan", "module.optimizer.weight_decay=nan must be a finite number >= 0"),
    ("module.optimizer.lr=inf", "module.optimizer.lr=inf must be a number > 0 (finite)"),
    ("module.optimizer.lr=-0.001", "module.optimizer.lr=-0.001 must be a number > 0"),
    ("+module.optimizer.eps=inf", "module.optimizer.eps=inf must be a finite number > 0"),
    ("module.scheduler.lr_min=-1e-5", "module.scheduler.lr_min=-1e-05 must be a finite number >= 0"),
    ("module.scheduler.warmup_lr_init=nan", "module.scheduler.warmup_lr_init=nan must be a finite number >= 0"),
    ("module.label_smoothing=-0.1", "module.label_smoothing=-0.1 must be in [0, 1)"),
    ("module.label_smoothing=nan", "module.label_smoothing=nan must be in [0, 1)"),
    ("module.warmup_fraction=inf", "module.warmup_fraction=inf must be in [0, 1)"),
    ("module.layer_decay=0", "module.layer_decay=0: expected a number in (0, 1], or null"),
    ("module.threshold=1.5", "module.threshold=1.5 must be a probability in (0, 1)"),
    ("model.drop_rate=1.0", "model.drop_rate=1.0 must be in [0, 1)"),
    ("trainer.gradient_clip_val=nan", "trainer.gradient_clip_val=nan must be a finite number >= 0"),
    ("module.distill.tau=inf", "module.distill.tau=inf must be a finite number"),
    ("module.asl.clip=nan", "module.asl.clip=nan must be a finite number"),
    ("experiment=caption_shapes module.beam_size=0", "module.beam_size=0 must be a positive integer (1: greedy)"),
]


@pytest.mark.parametrize("override, message", FAMILY, ids=[f[0] for f in FAMILY])
def test_a_bad_value_is_one_line_naming_it_and_the_valid_range_before_anything_is_built(
        cfg_factory, capsys, monkeypatch, override, message):
    """In process (the whole family, cheaply); the headline four also run through the real CLI below."""
    import vitpipe.tasks.train

    def built(*a, **k):
        raise AssertionError("the data, model or Trainer were built before the mistake was reported")

    monkeypatch.setattr(vitpipe.tasks.train, "build_from_config", built)
    monkeypatch.setattr(vitpipe.tasks.train, "build_trainer", built)
    monkeypatch.setattr(vitpipe.tasks.train.L, "seed_everything", built)  # checked before anything is seeded, too
    cfg = cfg_factory("debug=fast", "logger=none", *override.split())
    with pytest.raises(SystemExit) as stop:
        run_cli(vitpipe.tasks.train.train, cfg)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitpipe: error: {message}"), lines


@pytest.mark.parametrize("override", ["module.mixup={mixup_alpha:0.8,cutmix_alpha:1.0,prob:0.5,mode:elem}",
                                      "module.mixup={cutmix_alpha:1.0}", "seed=null", "seed=4294967295",
                                      "trainer.max_epochs=-1", "++trainer.limit_train_batches=0.5",
                                      "module.optimizer.weight_decay=0", "trainer.gradient_clip_val=null"])
def test_valid_values_at_the_edges_pass(cfg_factory, override):
    from vitpipe.config.preflight import check_config

    check_config(cfg_factory("debug=fast", "logger=none", "trainer.max_steps=5", override))


def test_eval_says_a_bad_seed_in_one_line_before_the_checkpoint_is_read(tmp_path):
    from conftest import make_cfg

    from vitpipe.errors import ConfigError
    from vitpipe.tasks.evaluate import evaluate

    cfg = make_cfg(tmp_path, [f"ckpt_path={tmp_path / 'no-such.ckpt'}", "seed=-5"], config_name="eval")
    with pytest.raises(ConfigError, match=r"^seed=-5 must be an integer in \[0, 4294967295\]"):
        evaluate(cfg)


HEADLINE = [
    ("seed=-5", "seed=-5 must be an integer in [0, 4294967295], or null (PL_GLOBAL_SEED, else 0)"),
    ("+module.mixup.mixup_alpha=-1", "module.mixup.mixup_alpha=-1 must be a finite number >= 0 (0: off)"),
    ("trainer.max_epochs=0", "trainer.max_epochs=0 must be an integer >= 1, or -1 (no limit: trainer.max_steps "
                             "ends the run), or null"),
    ("module.optimizer.weight_decay=inf", "module.optimizer.weight_decay=inf must be a finite number >= 0 (0: none)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("override, message", HEADLINE, ids=[h[0] for h in HEADLINE])
def test_train_cli_says_the_bad_value_in_one_line_before_the_data_is_touched(tmp_path, override, message):
    """As typed. The data is an image folder that is not there: its own check (before any image is read)
    would name the folder, so a line naming the value shows that the value was checked before the data.
    A valid value with the same folder gets that folder's error (the tripwire is live)."""
    work = fresh_checkout(tmp_path / "w")
    data = ["data=imagefolder", f"data.root={tmp_path / 'no-images'}", "data.num_classes=10", "logger=none",
            f"hydra.run.dir={tmp_path / 'run'}"]
    start = time.perf_counter()
    r = run(["python", "scripts/train.py", override, *data], work)
    took = time.perf_counter() - start
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"vitpipe: error: {message}"], r.stderr[-2000:]
    assert r.stdout.strip() == "", r.stdout[-2000:]  # nothing ran: not even "Seed set to"
    assert not (tmp_path / "run" / "config.yaml").exists() and not (tmp_path / "run" / "checkpoints").exists()
    assert took < 120  # Python and torch starting, nothing more (CI machines are slow and shared)
    if override == "seed=-5":
        ok = run(["python", "scripts/train.py", "seed=5", *data[:-1], f"hydra.run.dir={tmp_path / 'run2'}"], work)
        assert ok.returncode == 2 and "no-images/train does not exist" in ok.stderr.strip().splitlines()[-1], ok.stderr


# --------------------------------------------------------------------------- checkpoint writes (12b)


@pytest.mark.parametrize("every", [None, 3])
def test_each_epoch_end_writes_last_ckpt_once_and_the_best_checkpoint(cfg_factory, monkeypatch, every):
    """Every save counted (the checkpoint IO wrapped) over 2 epochs of 6 steps: last.ckpt is written once at
    each epoch end (and at each other N-th step with last_every_n_train_steps=N), and the best checkpoint is
    written at the end of the first epoch. A last.ckpt saved at a step boundary used to make Lightning skip
    the top-k save of that step: with N dividing the epoch, no best checkpoint was ever written."""
    import vitpipe.lit.checkpointing as checkpointing
    from vitpipe.tasks.train import train

    writes: list[tuple[str, int]] = []
    save = checkpointing.AtomicCheckpointIO.save_checkpoint

    def counted(self, checkpoint, path, storage_options=None):
        writes.append((Path(path).name, checkpoint["global_step"]))
        return save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(checkpointing.AtomicCheckpointIO, "save_checkpoint", counted)
    cfg = cfg_factory("debug=fast", "logger=none", "trainer.max_epochs=2", "trainer.limit_train_batches=6",
                      "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "module.optimizer.lr=0.01",
                      f"callbacks.model_checkpoint.last_every_n_train_steps={'null' if every is None else every}")
    train(cfg)
    last = [step for name, step in writes if name == "last.ckpt"]
    steps = sorted({6, 12} | ({s for s in range(1, 13) if s % every == 0} if every else set()))
    assert last == steps, writes  # once each: no step written twice, none left out
    best = [(name, step) for name, step in writes if name.startswith("epoch_")]
    assert best and best[0] == ("epoch_000.ckpt", 6), writes
    assert len(best) == len(set(best)), writes


# --------------------------------------------------------------------------- what leaves vitpipe (16)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """A real training run of the default config (vit_nano on the digits), debug=fast."""
    import tiny_checkpoints as tc

    return tc.trained_run(tmp_path_factory.mktemp("default_run"))


@pytest.mark.slow  # a training run, an ONNX export and predict: ~45 s on a shared 2-core machine
def test_onnx_of_a_default_run_carries_classes_and_preprocessing_a_consumer_reproduces_predict_with(
        default_run, tmp_path):
    """Someone with only the .onnx file: its metadata (read by onnxruntime) names the classes, the task, the
    input size, mode, mean, std and resize rule; feeding a PNG prepared by those alone gives predict.py's
    probabilities and label for that file."""
    import json

    import numpy as np
    import onnxruntime as ort
    from conftest import make_cfg
    from PIL import Image

    from vitpipe.tasks.export import export
    from vitpipe.tasks.predict import predict

    out = export(make_cfg(tmp_path / "e", [f"ckpt_path={default_run}", "format=onnx", f"out={tmp_path / 'm.onnx'}"],
                          config_name="export"))
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["task"] == "multiclass" and meta["producer"] == "vitpipe" and "softmax" in meta["outputs"]
    names = json.loads(meta["label_names"])
    assert names == [str(i) for i in range(10)] and meta["num_classes"] == "10"  # the digits' classes
    C, H, W = json.loads(meta["input_size"])
    mean, std = np.array(json.loads(meta["mean"])), np.array(json.loads(meta["std"]))
    assert (H, W) == (8, 8) and len(mean) == len(std) == C and (std > 0).all()
    assert meta["image_mode"] in ("L", "RGB") and meta["interpolation"] == "bilinear" and meta["inputs"] == "images"
    assert meta["crop_mode"] == "squash" and float(meta["crop_pct"]) == 1.0

    rng = np.random.default_rng(0)
    files = tmp_path / "files"
    files.mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (12, 10), dtype=np.uint8)).save(files / f"{i}.png")
    rows = predict(make_cfg(tmp_path / "p", [f"ckpt_path={default_run}", f"images={files}", "device=cpu",
                                             f"out={tmp_path / 'preds.json'}", "topk=1"], config_name="predict"))
    expected = {Path(r["path"]).name: r for r in json.loads(rows.read_text())}
    for f in sorted(files.iterdir()):
        image = Image.open(f).convert(meta["image_mode"]).resize((W, H), Image.Resampling.BILINEAR)
        x = np.asarray(image, dtype=np.float32).reshape(H, W, -1) / 255.0  # (H, W, channels)
        x = np.broadcast_to(x, (H, W, C)) if x.shape[-1] != C else x  # grayscale repeated to the input's channels
        x = ((x - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)  # (1, C, H, W)
        logits = session.run(None, {meta["inputs"]: x})[0][0]
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        assert names[int(probs.argmax())] == expected[f.name]["label"], f.name
        assert abs(float(probs.max()) - expected[f.name]["prob"]) < 1e-4, f.name


# --------------------------------------------------------------------------- documented outputs are ignored (17)


def documented_outputs() -> list[tuple[str, str]]:
    """(where, path) for every path a command of README.md or docs/*.md writes into the checkout: ``out=``,
    ``--out``, ``hydra.run.dir=``/``paths.*=`` values, folders a ``python -c`` line makes, and ``build`` for
    a ``pip install`` of the checkout (setuptools builds there). Placeholders, absolute paths and URLs
    are not the checkout's."""
    import re
    import shlex

    from readme_commands import shown_commands

    found = []
    for shown in shown_commands():
        try:
            args = shlex.split(shown.command)
        except ValueError:
            args = shown.command.split()
        values = []
        for i, arg in enumerate(args):
            key = re.match(r"^\+*(out|hydra\.(run|sweep)\.dir|paths\.\w+)=(?P<v>.+)$", arg)
            if key:
                values.append(key["v"])
            elif arg in ("--out", "--outdir", "--out-dir", "-o") and i + 1 < len(args):
                values.append(args[i + 1])
            elif arg.startswith("--out="):
                values.append(arg.split("=", 1)[1])
            values += re.findall(r"makedirs\(\s*['\"]([^'\"]+)['\"]", arg)
        if args[:2] == ["pip", "install"] and any(a == "." or a.startswith((".[", "-e.")) or a == "-e" for a in args):
            values.append("build")
        for v in values:
            if not any(c in v for c in "<>$*") and not v.startswith(("/", "~")) and "://" not in v:
                found.append((f"{shown.page}:{shown.line}", v.rstrip("/")))
    return found


def test_every_output_path_the_documented_commands_write_is_ignored_by_git():
    """README's commands left digits_png/, my_vit/, my_vit.onnx, preds.csv, figs/ and build/ untracked in
    the checkout. Outputs that are committed on purpose (the docs' figures under notebooks/figures/,
    docs/img/) are tracked files and are left out."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=root, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    outputs = documented_outputs()
    paths = {p for _, p in outputs}
    assert {"preds.csv", "my_vit", "my_vit.onnx", "figs", "digits_png", "build"} <= paths, sorted(paths)
    tracked = set(subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True).stdout.splitlines())
    for where, path in outputs:
        if path in tracked or any(t.startswith(path + "/") for t in tracked):
            continue  # committed on purpose (a figure the docs show)
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root)
        assert r.returncode == 0, f"{where} writes {path}, which git does not ignore: add /{path} to .gitignore"

"""Values that used to be checked only once training ran (or never) are one line before any data loads:
a seed numpy refuses, a mixup setting timm asserts on at the first batch, zero epochs, a NaN or an
infinity that torch's own checks let through (``weight_decay=inf`` stopped the run at step 1)."""

from __future__ import annotations

import time

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
    ("module.layer_decay=0", "module.layer_decay=0 must be in (0, 1], or null"),
    ("module.threshold=1.5", "module.threshold=1.5 must be a probability in (0, 1)"),
    ("model.drop_rate=1.0", "model.drop_rate=1.0 must be in [0, 1)"),
    ("trainer.gradient_clip_val=nan", "trainer.gradient_clip_val=nan must be a finite number >= 0"),
    ("module.distill.tau=inf", "module.distill.tau=inf must be a finite number"),
    ("module.asl.clip=nan", "module.asl.clip=nan must be a finite number"),
]


@pytest.mark.parametrize("override, message", FAMILY, ids=[f[0] for f in FAMILY])
def test_a_bad_value_is_one_line_naming_it_and_the_valid_range_before_anything_is_built(
        cfg_factory, capsys, monkeypatch, override, message):
    """In process (the whole family, cheaply); the headline four also run through the real CLI below."""
    import vitpipe.tasks.train

    def built(*a, **k):
        raise AssertionError("the data, model or Trainer were built before the mistake was reported")

    monkeypatch.setattr(vitpipe.tasks.train, "build", built)
    monkeypatch.setattr(vitpipe.tasks.train, "instantiate_checked", built)
    monkeypatch.setattr(vitpipe.tasks.train.L, "seed_everything", built)  # checked before anything is seeded, too
    cfg = cfg_factory("debug=fast", "logger=none", override)
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
    from vitpipe.config.build import check_config

    check_config(cfg_factory("debug=fast", "logger=none", "trainer.max_steps=5", override))


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

"""The MAE experiment of docs/mae.md, as a user types it: ``experiment=mae_fmnist`` pre-trains on
Fashion-MNIST's 60k training images (labels unused), then ``experiment=mae_fmnist_finetune`` with 1%
of the labels (60 per class) from that run beats the same classifier trained from scratch on the
same 600 images. Real data, real commands, in subprocesses from a fresh checkout.

The pre-training took 25.5 minutes on the 2-core AMD EPYC; ``VITPIPE_MAE_RUN=<a finished
experiment=mae_fmnist run dir>`` reuses one instead (the two fine-tuning runs are ~3 minutes each)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from user_shell import fresh_checkout, run, run_dir_of

DEBIAN_FMNIST = "/usr/share/datasets/fashion-mnist"
# docs/mae.md's table, 1% labels at 100 epochs (500 steps): MAE + fine-tune 0.8137 / 0.8182 / 0.8081,
# scratch 0.7420 / 0.7359 / 0.7452 (seeds 0, 1, 2: 6.3-8.2 points apart); asked here at seed 0: 5
WIN = 0.05
ONE_PERCENT = "data.train_per_class=60 trainer.max_epochs=100 trainer.check_val_every_n_epoch=10"


def _test_acc(stdout: str) -> float:
    return json.loads((run_dir_of(stdout) / "metrics.json").read_text())["test/acc"]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(DEBIAN_FMNIST), reason="Debian's dataset-fashion-mnist is not installed")
def test_mae_pre_training_then_fine_tuning_beats_scratch_at_1_percent_labels(tmp_path):
    where = fresh_checkout(tmp_path / "checkout")
    mae_run = os.environ.get("VITPIPE_MAE_RUN")
    if not mae_run:
        pre = run("python scripts/train.py experiment=mae_fmnist", where, timeout=50 * 60)
        assert pre.returncode == 0, pre.stderr[-3000:]
        mae_run = str(run_dir_of(pre.stdout))
    assert (Path(mae_run) / "metrics.json").is_file(), f"{mae_run} is not a finished MAE run"
    accs = {}
    for arm, pretrained in (("mae", mae_run), ("scratch", "null")):
        r = run(f"python scripts/train.py experiment=mae_fmnist_finetune model.pretrained={pretrained} {ONE_PERCENT}",
                where, timeout=20 * 60)
        assert r.returncode == 0, r.stderr[-3000:]
        accs[arm] = _test_acc(r.stdout)
    assert accs["mae"] > accs["scratch"] + WIN, accs

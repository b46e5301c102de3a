"""scripts/naflex_curve.py's pieces: the equal-steps token budget, the commands it runs (the user's CLI),
the results table and the plot (the full run: the README commands test, shortened)."""

from __future__ import annotations

import csv

from vitpipe.tasks.naflex_curve import BATCH, equal_steps_budget, eval_command, plot, train_command, write_csv


def test_the_equal_steps_budget_gives_a_batch_of_images_on_average():
    lens = [9, 16, 25, 36, 49]
    budget = equal_steps_budget(lens)
    per_batch = [budget // n for n in lens]  # what TokenBudgetBatchSampler puts in a batch at each length
    assert abs(sum(per_batch) / len(per_batch) - BATCH) < 1.0
    assert equal_steps_budget([49]) == BATCH * 49  # one length: the fixed batch at that length


def test_commands_train_and_test_each_model_as_a_user_would(tmp_path):
    kw = dict(grids=[3, 7], epochs=2, train_per_class=5, seed=1)
    naflex = train_command(tmp_path / "n", naflex=True, tokens_per_batch=300, **kw)
    assert naflex[1:4] == ["-m", "vitpipe", "train"]  # `vitpipe train`: a checkout or a wheel
    assert {"data.naflex.enabled=true", "data.naflex.seq_lens=[9,49]", "data.naflex.max_seq_len=49",
            "data.naflex.tokens_per_batch=300", "data.hflip=false", "model.img_size=28", "seed=1"} <= set(naflex)
    fixed = train_command(tmp_path / "f", naflex=False, side=3, **kw)
    assert {"model.img_size=12", "data.augment=false", "trainer.max_epochs=2"} <= set(fixed)
    assert not any(a.startswith("data.naflex") for a in fixed)
    assert "data.naflex.max_seq_len=9" in eval_command(tmp_path / "n", naflex=True, side=3)
    assert "data.img_size=12" in eval_command(tmp_path / "f", naflex=False, side=3)


def test_results_table_and_plot(tmp_path):
    rows = [{"model": m, "trained_tokens": t, "tokens": n, "test_acc": a} for m, t, n, a in [
        ("naflex", "9/49", 9, 0.5), ("naflex", "9/49", 49, 0.6), ("naflex_steps", "9/49", 9, 0.7),
        ("naflex_steps", "9/49", 49, 0.72), ("fixed", 9, 9, 0.8), ("fixed", 49, 49, 0.81), ("fixed", 49, 9, 0.3)]]
    write_csv(rows, tmp_path / "results.csv")
    with open(tmp_path / "results.csv") as f:
        back = list(csv.DictReader(f))
    assert [(r["model"], r["tokens"], float(r["test_acc"])) for r in back] == [
        (r["model"], str(r["tokens"]), r["test_acc"]) for r in rows]
    png = plot(rows, tmp_path / "curve.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".png"] == ["curve.png"]

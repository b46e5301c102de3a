"""naflex_curve: test accuracy against sequence length, NaFlex models against fixed-size models.

    python scripts/naflex_curve.py --out logs/naflex_curve [--epochs 10 --train-per-class 600 --seed 0]

The figure of NaViT (Dehghani et al. 2023, Fig. 1) and FlexiViT (Beyer et al. 2023): on Fashion-MNIST
with vit_micro at 4-px patches, grid sides ``--grids`` (default 3..7: 9, 16, 25, 36, 49 patches)

* two models trained with ``data.naflex`` drawing a sequence length per batch from all of them,
  tested at each length (``scripts/eval.py ... data.naflex.max_seq_len=L``): one at timm's token
  budget (``tokens_per_batch`` null: ``data.batch_size`` images at the longest length, many more at
  short ones, so fewer steps per epoch), one at the budget that gives the fixed models' steps per
  epoch (``tokens_per_batch = batch / mean(1 / L)``: ``data.batch_size`` images per batch on average);
* one fixed-size model per length, trained at ``model.img_size = 4 * side`` (the data resized to it),
  tested at its own size; the largest of them also tested at every other size
  (``scripts/eval.py ... data.img_size=S``: positions resampled), the curve of a model trained at one size.

Same images, epochs, optimizer and seed for every model, and no augmentation on either path
(``data.augment=false`` for the fixed path: no crop, no flip; ``data.hflip=false`` for NaFlex, whose
only augmentation is the flip). Each step is
the real CLI in a subprocess, printed before it runs; every run has its own ``paths.log_dir`` under
``--out``, so ``ckpt_path=last`` picks it. A run whose ``metrics.json`` already exists is not repeated
(``--out`` of an interrupted call continues). Writes ``results.csv`` and ``seq_len_curve.png`` (atomic);
each command's output goes to ``<run log dir>/<step>.log``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from vitpipe.run.csvfiles import dict_csv_text
from vitpipe.run.files import atomic_write_text, save_figure

PATCH = 4
VITPIPE = [sys.executable, "-m", "vitpipe"]  # the user's CLI, `vitpipe <command>`, with this interpreter


BATCH = 128  # conf/data/fashion_mnist.yaml's batch_size


def equal_steps_budget(lens: list[int], batch: int = BATCH) -> int:
    """Tokens per batch for which a batch holds ``batch`` images on average over the drawn lengths."""
    return round(batch / (sum(1 / n for n in lens) / len(lens)))


def train_command(log_dir: Path, *, grids: list[int], epochs: int, train_per_class: int, seed: int,
                  naflex: bool, side: int | None = None, tokens_per_batch: int | None = None) -> list[str]:
    lens = [g * g for g in grids]
    common = ["data=fashion_mnist", f"data.train_per_class={train_per_class}", f"trainer.max_epochs={epochs}",
              f"seed={seed}", "logger=csv", f"paths.log_dir={log_dir}"]
    if naflex:
        model = ["model=vit_micro", f"model.img_size={PATCH * max(grids)}", "data.naflex.enabled=true",
                 f"data.naflex.seq_lens=[{','.join(map(str, lens))}]", f"data.naflex.max_seq_len={max(lens)}",
                 "data.hflip=false"]
        if tokens_per_batch is not None:
            model.append(f"data.naflex.tokens_per_batch={tokens_per_batch}")
    else:
        model = ["model=vit_micro", f"model.img_size={PATCH * side}", "data.augment=false"]
    return [*VITPIPE, "train", *model, *common]


def eval_command(log_dir: Path, *, naflex: bool, side: int) -> list[str]:
    data = (["data.naflex.enabled=true", f"data.naflex.seq_lens=[{side * side}]", f"data.naflex.max_seq_len={side * side}"]
            if naflex else [f"data.img_size={PATCH * side}"])
    return [*VITPIPE, "eval", "ckpt_path=last", "data=fashion_mnist", *data,
            f"paths.log_dir={log_dir}"]


def newest_metrics(log_dir: Path, task: str) -> Path | None:
    runs = sorted((log_dir / task / "runs").glob("*/metrics.json"))
    return runs[-1] if runs else None


def run(cmd: list[str], log_dir: Path, task: str, *, tag: str) -> dict:
    """``cmd`` unless a ``tag``-marked earlier call finished; the test metrics of the run."""
    done = log_dir / f"{tag}.json"
    if done.is_file():
        return json.loads(done.read_text())
    print("$ " + shlex.join(["python", *cmd[1:]]), flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{tag}.log"
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode  # in the user's directory
    if code:
        tail = log.read_text().strip().splitlines()[-1:] or [""]
        raise SystemExit(f"naflex_curve: exit {code} from the command above ({log}): {tail[0]}")
    metrics = json.loads(newest_metrics(log_dir, task).read_text())
    atomic_write_text(done, json.dumps(metrics, indent=1))
    return metrics


def curve(out: Path, *, grids: list[int], epochs: int, train_per_class: int, seed: int) -> list[dict]:
    rows = []
    kw = dict(grids=grids, epochs=epochs, train_per_class=train_per_class, seed=seed)
    for name, budget in (("naflex", None), ("naflex_steps", equal_steps_budget([g * g for g in grids]))):
        nf = out / name
        run(train_command(nf, naflex=True, tokens_per_batch=budget, **kw), nf, "train", tag="train")
        for side in grids:
            m = run(eval_command(nf, naflex=True, side=side), nf, "eval", tag=f"eval_{side * side}")
            rows.append({"model": name, "trained_tokens": "/".join(str(g * g) for g in grids),
                         "tokens": side * side, "test_acc": m["test/acc"]})
    for side in grids:
        fx = out / f"fixed_{side * side}"
        m = run(train_command(fx, naflex=False, side=side, **kw), fx, "train", tag="train")
        rows.append({"model": "fixed", "trained_tokens": side * side, "tokens": side * side,
                     "test_acc": m["test/acc"]})
    longest = out / f"fixed_{max(grids) ** 2}"
    for side in grids:
        if side != max(grids):
            m = run(eval_command(longest, naflex=False, side=side), longest, "eval", tag=f"eval_{side * side}")
            rows.append({"model": "fixed", "trained_tokens": max(grids) ** 2, "tokens": side * side,
                         "test_acc": m["test/acc"]})
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    atomic_write_text(path, dict_csv_text(rows, ["model", "trained_tokens", "tokens", "test_acc"]))


def plot(rows: list[dict], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    nf = sorted((r["tokens"], r["test_acc"]) for r in rows if r["model"] == "naflex")
    nf_steps = sorted((r["tokens"], r["test_acc"]) for r in rows if r["model"] == "naflex_steps")
    own = sorted((r["tokens"], r["test_acc"]) for r in rows if r["model"] == "fixed"
                 and r["trained_tokens"] == r["tokens"])
    longest = max(r["tokens"] for r in rows)
    one = sorted((r["tokens"], r["test_acc"]) for r in rows if r["model"] == "fixed"
                 and r["trained_tokens"] == longest)
    ax.plot(*zip(*nf_steps), "o-", color="C0", label="NaFlex, the fixed models' steps, tested at each length")
    ax.plot(*zip(*nf), "o-", color="C0", alpha=0.45, label="NaFlex, timm's token budget (fewer steps)")
    ax.plot(*zip(*own), "s--", color="C1", label="fixed-size models, one per length")
    ax.plot(*zip(*one), "x:", color="C2", label=f"the fixed model trained at {longest}, at each length")
    ax.set_xlabel("patches per image (sequence length)")
    ax.set_ylabel("test accuracy")
    ax.set_xticks([t for t, _ in nf])
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    saved = save_figure(fig, path, dpi=110)
    plt.close(fig)
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for the runs, results.csv and the plot")
    p.add_argument("--grids", type=int, nargs="+", default=[3, 4, 5, 6, 7], help="grid sides (4-px patches)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bad = [g for g in args.grids if g < 1 or g > 7]
    if bad or len(set(args.grids)) < 2:
        p.error(f"--grids {args.grids}: use two or more distinct sides in 1..7 (28-px Fashion-MNIST, 4-px patches)")
    if args.epochs < 1 or args.train_per_class < 1:
        p.error(f"--epochs {args.epochs} --train-per-class {args.train_per_class}: use positive integers")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = curve(out, grids=sorted(args.grids), epochs=args.epochs, train_per_class=args.train_per_class,
                 seed=args.seed)
    write_csv(rows, out / "results.csv")
    title = (f"Fashion-MNIST, vit_micro, {args.train_per_class * 10} training images, {args.epochs} epochs, "
             f"seed {args.seed}")
    print(f"wrote {out / 'results.csv'} and {plot(rows, out / 'seq_len_curve.png', title=title)}")
    for r in rows:
        print(f"  {r['model']:>12} trained at {r['trained_tokens']!s:>14}  tested at {r['tokens']:>2}: "
              f"{r['test_acc']:.4f}")
    return 0

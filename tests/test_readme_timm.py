"""The timm snippet of docs/using-a-model.md ("End to end on the default run"), run as written: the
exported timm folder, loaded with timm alone, prints the label and the probability that
scripts/predict.py writes for the same image."""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_checkpoints as tc
from conftest import make_cfg

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "using-a-model.md"   # the page that shows the end-to-end block and the timm snippet


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), flags=re.S)


def timm_snippet() -> str:
    found = [b for b in readme_blocks("python") if 'timm.create_model("local-dir:' in b]
    assert len(found) == 1, "docs/using-a-model.md has one python block that loads the exported timm folder"
    return found[0]


def digits_png_command() -> list[str]:
    """The page's `python -c ...` line that writes digits_png/ (the end-to-end block), as argv."""
    lines = [ln for b in readme_blocks("bash") for ln in b.splitlines()
             if ln.startswith("python -c") and "digits_png" in ln]
    assert len(lines) == 1, lines
    argv = shlex.split(lines[0])
    return [sys.executable, *argv[1:]]


def test_readme_timm_snippet_prints_predicts_label_and_probability(tmp_path, monkeypatch, capsys):
    from vitpipe.tasks.export import export
    from vitpipe.tasks.predict import predict

    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(digits_png_command(), cwd=work, check=True, timeout=120)
    ckpt = tc.checkpoint("learned", tmp_path / "ckpts")  # vit_nano on 8x8 digits, random weights
    export(make_cfg(tmp_path / "e", [f"ckpt_path={ckpt}", "format=timm", f"out={work / 'vit_nano_digits'}"],
                    config_name="export"))
    out = predict(make_cfg(tmp_path / "p", [f"ckpt_path={ckpt}", f"images={work / 'digits_png'}", "topk=3",
                                            f"out={work / 'preds.csv'}", "device=cpu"], config_name="predict"))
    with out.open() as f:
        rows = {Path(r["path"]).name: r for r in csv.DictReader(f)}
    capsys.readouterr()

    monkeypatch.chdir(work)  # the snippet names its files relative to where the page's commands ran
    exec(compile(timm_snippet(), str(PAGE), "exec"), {})
    printed = capsys.readouterr().out.split()
    image = re.search(r'Image\.open\("digits_png/([^"]+)"\)', timm_snippet()).group(1)
    row = rows[image]
    assert len(printed) == 2, f"the snippet should print a label and a probability, printed {printed}"
    assert printed[0] == row["label"]
    assert float(printed[1]) == pytest.approx(float(row["prob"]), abs=1e-5)
    assert 0.0 < float(printed[1]) <= 1.0

"""The notebooks run top to bottom on CPU, without errors, and draw their figures.

Each is executed by a fresh ipykernel (this interpreter's environment) in a temporary directory, as a
reader would run it; the time it took is printed (pytest -s).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
BUDGET_S = 240  # each is ~45-90 s on 2 busy cores; this only catches a runaway


def execute(name: str, tmp_path: Path, monkeypatch, first_cell: str | None = None):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    has_outputs = any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    assert not has_outputs, f"{name}: strip the outputs before committing"
    if first_cell is not None:
        nb.cells[1].source = first_cell
    # the kernelspec runs `python`: make it this interpreter (the venv), whatever PATH the test runner has
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=BUDGET_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.perf_counter() - start
    print(f"\n{name}: executed in {seconds:.0f} s")
    return nb, seconds


def outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in o.get("data", {})]


def stdout(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.timeout(BUDGET_S + 60)
def test_attention_rollout_notebook(tmp_path, monkeypatch):
    nb, seconds = execute("attention_rollout.ipynb", tmp_path, monkeypatch)
    assert len(outputs(nb, "image/png")) == 4  # rollout, sharpened rollout, gradient rollout, heads
    text = stdout(nb)
    assert "maps: (8, 4, 4)" in text
    correct = int(text.split("correct: ")[1].split(" of")[0])
    assert correct >= 6  # the quadrant task is learned, so the maps explain a working model
    assert seconds < BUDGET_S


@pytest.mark.timeout(BUDGET_S + 60)
def test_captioning_notebook(tmp_path, monkeypatch):
    nb, seconds = execute("captioning_attention.ipynb", tmp_path, monkeypatch)
    assert len(outputs(nb, "image/png")) == 4 + 1  # one figure per image, then the encoder's rollout
    captions = [line for line in stdout(nb).splitlines() if "reference:" in line]
    assert len(captions) == 4
    assert any(w in captions[0] for w in ("circle", "square", "triangle"))  # it learned to name shapes
    assert seconds < BUDGET_S


def test_rollout_notebook_loads_a_checkpoint(tmp_path, monkeypatch):
    """With CKPT set, the notebook explains that checkpoint on its test images instead of training."""
    import torch

    from conftest import make_cfg
    from vitpipe.train import train

    cfg = make_cfg(tmp_path / "train", ["model=vit_micro", "debug=fast", "test=false", "model.depth=2"])
    train(cfg)
    ckpt = next((Path(cfg.paths.output_dir) / "checkpoints").glob("epoch_*.ckpt"))
    assert "vitpipe_config" in torch.load(ckpt, weights_only=True)
    nb, _ = execute("attention_rollout.ipynb", tmp_path, monkeypatch,
                    first_cell=f"CKPT = {str(ckpt)!r}\nNUM_IMAGES = 4\nSTEPS = 0")
    assert len(outputs(nb, "image/png")) == 4
    text = stdout(nb)
    assert "loaded vit_micro trained on DigitsDataModule" in text and "maps: (4, 8, 8)" in text

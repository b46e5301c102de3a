"""What export writes for sharing holds no local path: the model card (README.md), config.json and the
ONNX file. Paths are planted where a real run keeps them: the stored config (paths.*, data.root,
model.pretrained, module.distill.teacher, a free-text field), Hydra's overrides.yaml (the training
command), a run directory under the home directory; a path under the directory training started in
becomes relative to it, any other one ``<local path>``."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import tiny_checkpoints as tc
import torch
from conftest import make_cfg

from vitpipe.tasks.export import export

ROOT = Path(__file__).resolve().parents[1]
# an absolute path inside text: "/x..." after a start, a space, a quote, "=", "(", "[", "{" or ",";
# "~/x", "~user/x", "file:///x" and "C:\x" too (URLs such as https://host/x are not paths)
ABSOLUTE = re.compile(r"""(?:^|[\s"'=(\[{,:])(?:/[^\s/"'`<>]|~[\w.-]*/|[A-Za-z]:\\)""", re.M)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A copy of the tiny trained run inside a fake home directory, its stored config and overrides full
    of absolute paths; returns (checkpoint, home, root_dir)."""
    home = tmp_path_factory.mktemp("home") / "alice"
    root_dir = home / "projects" / "vit"  # where `python scripts/train.py` was started
    run = root_dir / "logs" / "train" / "runs" / "2024-01-01_00-00-00"
    shutil.copytree(tc.trained_run(tmp_path_factory.mktemp("trained")), run)
    teacher, mae = "/srv/models/alice/teacher.ckpt", f"{home}/mae runs/checkpoints/last.ckpt"
    for name in ("epoch_000.ckpt", "last.ckpt"):
        ckpt = torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)
        c = ckpt["vitpipe_config"]
        c["paths"] = {"root_dir": str(root_dir), "data_dir": f"{root_dir}/data", "log_dir": f"{root_dir}/logs",
                      "output_dir": str(run)}
        c["data"]["root"] = f"{root_dir}/data/digits"
        c["model"]["pretrained"] = mae
        c["module"]["distill"] = {**(c["module"].get("distill") or {}), "teacher": teacher}
        c["ckpt_path"] = f"{home}/old/last.ckpt"
        c["notes"] = f"first try, see {home}/notes.txt and file://{home}/x.png (https://example.org/a/b stays)"
        torch.save(ckpt, run / "checkpoints" / name)
    (run / ".hydra" / "overrides.yaml").write_text("\n".join([
        "- debug=fast", "- logger=none", f"- data.root={root_dir}/data/digits", f"- module.distill.teacher={teacher}",
        f"- model.pretrained='{mae}'", f"- paths.log_dir={home}/logs", f"- hydra.run.dir={run}",
        "- trainer.max_epochs=1", "- +trainer.default_root_dir=~/scratch"]) + "\n")
    return run / "checkpoints" / "epoch_000.ckpt", home, root_dir


def _leaks(text: str, *where: Path) -> list[str]:
    found = [m.group(0) for m in ABSOLUTE.finditer(text)]
    found += [str(w) for w in where if str(w) in text]
    return found + [s for s in ("alice", str(ROOT), sys.prefix) if s in text]


def test_timm_export_writes_no_local_path(planted, tmp_path, monkeypatch):
    ckpt, home, root_dir = planted
    monkeypatch.setenv("HOME", str(home))
    out = export(make_cfg(tmp_path, [f"ckpt_path={ckpt}", "format=timm", f"out={tmp_path / 'vit'}"],
                          config_name="export"))
    texts = {p.name: p.read_text(encoding="utf-8") for p in out.iterdir() if p.suffix in (".md", ".json")}
    assert set(texts) == {"README.md", "config.json"}
    for name, text in texts.items():
        assert _leaks(text, home, root_dir, tmp_path) == [], name
    card = texts["README.md"]
    # relativised where they were under the directory training started in, a marker elsewhere; the rest kept
    assert "data.root=data/digits" in card and "root: data/digits" in card
    assert "module.distill.teacher=<local path>" in card and "teacher: <local path>" in card
    assert "https://example.org/a/b stays" in card and "python scripts/train.py debug=fast logger=none" in card
    assert "paths.log_dir" not in card and "hydra.run.dir" not in card  # the machine's own settings: left out


def test_onnx_export_writes_no_local_path(planted, tmp_path):
    ckpt, home, root_dir = planted
    out = export(make_cfg(tmp_path, [f"ckpt_path={ckpt}", "format=onnx", f"out={tmp_path / 'm.onnx'}"],
                          config_name="export"))
    data = out.read_bytes()
    # torch's exporter records each node's Python stack (source files of vitpipe, torch, timm)
    for where in (ROOT, Path(sys.prefix), home, tmp_path, Path(torch.__file__).parent):
        assert str(where).encode() not in data, where
    import onnxruntime as ort

    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])  # still a valid model

"""Exports under ``kill -9`` and over existing outputs; class names that look like markdown or HTML.

The kill tests run the real ``scripts/export.py`` in a subprocess and SIGKILL it at the first moment
the export touches its folder, or once it has written its bytes: what is left under the final name
must be the old export, byte for byte and still loadable, or nothing when there was none.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import tiny_checkpoints as tc
import torch
from conftest import make_cfg

from vitpipe.run.checkpoint import rebuild
from vitpipe.run.stored import load_checkpoint
from vitpipe.tasks.cli import run_cli
from vitpipe.tasks.export import export

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# each a markdown or HTML construct that would change a table, a list or a link if written raw
HOSTILE = ["a|b", "<script>alert(1)</script>", "[x](http://evil.example)", "c, d", "back\\slash\\", "`tick`",
           "*star* _under_ ~~gone~~", "line\nbreak", "www.evil.example", "&lt;entity&gt; $x$ me@evil.example"]
AUTOLINK = re.compile(r"(?i)(https?|ftp)://|www\.|\w@\w")  # what GitHub's markdown links without brackets


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return tc.checkpoint("sincos2d", tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="session")
def old_ckpt(tmp_path_factory):
    """The network of the earlier export that a killed one replaces: other weights, so other bytes."""
    return tc.checkpoint("learned", tmp_path_factory.mktemp("ckpts"))


def export_cfg(tmp_path: Path, ckpt, fmt: str, out, *overrides: str):
    return make_cfg(tmp_path, [f"ckpt_path={ckpt}", f"format={fmt}", f"out={out}", *overrides], config_name="export")


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of everything under folder."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def kill_export_when(tmp_path: Path, ckpt, fmt: str, out: Path, condition, *overrides: str) -> None:
    """Run scripts/export.py and SIGKILL it the first time ``condition()`` holds (polled every 2 ms)."""
    proc = subprocess.Popen([sys.executable, "scripts/export.py", f"ckpt_path={ckpt}", f"format={fmt}", f"out={out}",
                             *overrides, f"hydra.run.dir={tmp_path}/hydra"], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if condition():
                proc.send_signal(signal.SIGKILL)
                assert proc.wait() == -signal.SIGKILL
                return
            time.sleep(0.002)
        pytest.fail(f"the export ended (status {proc.returncode}) before the moment to kill it came: "
                    f"{proc.stderr.read()[-1500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def onnx_logits(path: Path, x: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"images": x.numpy()})[0]


def checkpoint_logits(path, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return rebuild(load_checkpoint(path), path).net.eval()(x).numpy()


# ---- ONNX: a temp file beside out, checked in onnxruntime, renamed over it ------------------------

def _changed(folder: Path, before: dict, *, written: bool):
    """The first change in ``folder`` (written=False), or the first new file with bytes in it / a change of an
    existing one (written=True)."""
    def condition() -> bool:
        try:
            now = snapshot(folder)
        except FileNotFoundError:  # a temp file renamed between listing and stat
            return False
        if any(now.get(name) != stat for name, stat in before.items()):
            return True  # an existing file was touched
        new = [now[name] for name in now if name not in before]
        return any(size > 0 for size, _ in new) if written else bool(new)
    return condition


@pytest.mark.slow  # three killed ONNX exports (~25 s): .ci/run runs it after the default suite
@pytest.mark.parametrize("existing, moment", [(True, "first change"), (True, "bytes written"), (False, "first change")])
def test_kill_9_during_onnx_export_leaves_the_old_file_or_none(ckpt, old_ckpt, tmp_path, existing, moment):
    folder = tmp_path / "exports"
    out = folder / "x.onnx"
    folder.mkdir()
    if existing:  # a good export from earlier (in-process: the subprocess is the one killed)
        export(export_cfg(tmp_path / "first", old_ckpt, "onnx", out))
        old = out.read_bytes()
    kill_export_when(tmp_path, ckpt, "onnx", out, _changed(folder, snapshot(folder), written=moment == "bytes written"))
    left = sorted(p.name for p in folder.iterdir())
    print(f"left after kill at {moment}: {left}")
    assert all(name == "x.onnx" or name.startswith(".x.onnx.tmp-") for name in left), left
    x = torch.randn(2, 1, 8, 8)
    if existing:
        assert out.read_bytes() == old  # the old file, byte for byte
        assert np.abs(onnx_logits(out, x) - checkpoint_logits(old_ckpt, x)).max() <= 1e-4  # and it still runs
    else:
        assert not out.exists()  # no truncated file under the final name
    export(export_cfg(tmp_path / "again", ckpt, "onnx", out))  # the next export removes the killed one's temp file
    assert [p.name for p in folder.iterdir()] == ["x.onnx"]
    assert np.abs(onnx_logits(out, x) - checkpoint_logits(ckpt, x)).max() <= 1e-4


# ---- timm folder: a temp sibling folder, checked through timm, renamed into place ----------------------

def test_timm_export_refuses_a_non_empty_folder_before_loading_the_model(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "vit"
    out.mkdir()
    (out / "README.md").write_text("my own notes\n")
    (out / "keep.txt").write_text("a user file\n")
    before = contents(out)

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before out= was checked")

    monkeypatch.setattr("vitpipe.run.stored.load_checkpoint", no_loading)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(export, export_cfg(tmp_path, ckpt, "timm", out))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert err == [f"vitpipe: error: out={out} exists and is not empty (holds 2 files, e.g. README.md); "
                   "pass overwrite=true to replace it or choose another out="], err
    assert contents(out) == before and [p.name for p in tmp_path.iterdir()] == ["vit"]


def test_timm_export_overwrite_true_replaces_the_folder(ckpt, tmp_path):
    out = tmp_path / "vit"
    out.mkdir()
    (out / "keep.txt").write_text("a user file\n")
    (out / "README.md").write_text("my own notes\n")
    export(export_cfg(tmp_path, ckpt, "timm", out, "overwrite=true"))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert "Model card" in (out / "README.md").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name != "run"] == ["vit"]  # no temp or old folder left
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        got = timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x).numpy()
    assert np.abs(got - checkpoint_logits(ckpt, x)).max() <= 1e-5


def test_timm_export_into_an_empty_folder_needs_no_overwrite(ckpt, tmp_path):
    out = tmp_path / "vit"
    out.mkdir()
    export(export_cfg(tmp_path, ckpt, "timm", out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("moment", ["first change", "staged"])
def test_kill_9_during_timm_overwrite_leaves_a_loadable_export(ckpt, old_ckpt, tmp_path, moment):
    folder = tmp_path / "exports"
    out = folder / "vit"
    export(export_cfg(tmp_path / "first", old_ckpt, "timm", out))
    old = contents(out)
    before = snapshot(folder)

    def condition() -> bool:
        try:
            now = snapshot(folder)
        except FileNotFoundError:
            return False
        if any(now.get(name) != stat for name, stat in before.items()):
            return True  # a file of the existing export was touched
        new = [name for name in now if name not in before]
        return any(name.endswith("README.md") for name in new) if moment == "staged" else bool(new)

    kill_export_when(tmp_path, ckpt, "timm", out, condition, "overwrite=true")
    left = sorted(p.name for p in folder.iterdir())
    print(f"left after kill at {moment}: {left}")
    assert all(name == "vit" or name.startswith(".vit.tmp-") for name in left), left
    assert contents(out) == old  # the old export, file for file, byte for byte
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        got = timm.create_model(f"local-dir:{out}", pretrained=True).eval()(x).numpy()
    assert np.abs(got - checkpoint_logits(old_ckpt, x)).max() <= 1e-5
    export(export_cfg(tmp_path / "again", ckpt, "timm", out, "overwrite=true"))  # removes the killed one's folder
    assert [p.name for p in folder.iterdir()] == ["vit"]


def test_a_failed_check_leaves_the_earlier_export_and_no_temp_files(ckpt, old_ckpt, tmp_path, monkeypatch):
    """An export whose check fails (tolerance below any difference) writes nothing: the earlier file and
    folder stay byte for byte, and nothing is left beside them."""
    from vitpipe.errors import ExportCheckError

    onnx_out, timm_out = tmp_path / "x" / "m.onnx", tmp_path / "x" / "vit"
    export(export_cfg(tmp_path / "a", old_ckpt, "onnx", onnx_out))
    export(export_cfg(tmp_path / "b", old_ckpt, "timm", timm_out))
    old_onnx, old_timm = onnx_out.read_bytes(), contents(timm_out)
    monkeypatch.setattr("vitpipe.export.onnx_format.ONNX_TOLERANCE", -1.0)
    monkeypatch.setattr("vitpipe.export.timm_format.TIMM_TOLERANCE", -1.0)
    with pytest.raises(ExportCheckError, match="nothing was written"):
        export(export_cfg(tmp_path / "c", ckpt, "onnx", onnx_out))
    with pytest.raises(ExportCheckError, match="left as it was"):
        export(export_cfg(tmp_path / "d", ckpt, "timm", timm_out, "overwrite=true"))
    assert onnx_out.read_bytes() == old_onnx and contents(timm_out) == old_timm
    assert sorted(p.name for p in onnx_out.parent.iterdir()) == ["m.onnx", "vit"]


def test_stale_temp_cleanup_for_one_out_removes_only_dead_vitpipe_temps_of_that_name(tmp_path):
    """What the next export removes beside out: temp files and folders of out's name whose writer is dead;
    not a live writer's, not another name's, not a file that only looks like one (the folder is the user's)."""
    import socket

    from vitpipe.run.files import remove_stale_temp_files

    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()  # a running process that is not this one
    gone = [tmp_path / f".vit.tmp-{host}-{dead.pid}-abc123", tmp_path / f".vit.tmp-{host}-{dead.pid}-def456"]
    kept = [tmp_path / f".vit.tmp-{host}-{live}-abc123", tmp_path / f".other.tmp-{host}-{dead.pid}-abc123",
            tmp_path / ".vit.tmp-my-notes", tmp_path / "vit"]
    gone[0].mkdir()
    (gone[0] / "config.json").write_text("{}")
    gone[1].write_bytes(b"partial")
    for p in kept:
        p.write_text("keep")
    assert sorted(remove_stale_temp_files(tmp_path, name="vit")) == sorted(gone)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)


def test_overwrite_and_out_mistakes_are_one_line_errors(ckpt, tmp_path, capsys):
    (tmp_path / "a.onnx").mkdir()
    for args, expected in ((("timm", tmp_path / "vit", "overwrite=maybe"), "overwrite='maybe'; valid: true"),
                           (("onnx", tmp_path / "a.onnx"), "is a folder; format=onnx writes one .onnx file")):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(export, export_cfg(tmp_path, ckpt, *args))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and expected in err[0], err


# ---- class names in report.md and the model card -------------------------------------------------------

def _inline_text(token) -> str:
    """The text a markdown inline token renders to; fails on any markup (a link, emphasis, HTML, code)."""
    kinds = {c.type for c in token.children}
    assert kinds <= {"text"}, (token.content, kinds)
    return "".join(c.content for c in token.children)


def test_report_md_table_keeps_hostile_class_names_in_one_cell(tmp_path):
    from markdown_it import MarkdownIt

    from vitpipe.report import write_report
    from vitpipe.report.predictions import Predictions

    names = HOSTILE + ["  edge spaces ", "plain"]
    c = len(names)
    torch.manual_seed(0)
    target = torch.arange(4 * c) % c  # every class has support
    preds = Predictions.from_logits(torch.arange(4 * c), torch.randn(4 * c, c), target)
    (tmp_path / "run").mkdir()
    preds.write(tmp_path / "run" / "predictions.csv", names)
    write_report(tmp_path / "run", names)
    md = (tmp_path / "run" / "report" / "report.md").read_text()
    tokens = MarkdownIt("commonmark").enable("table").parse(md)
    tables, row = [], None
    for t in tokens:
        if t.type == "table_open":
            tables.append([])
        elif t.type == "tr_open":
            row = []
        elif t.type == "inline" and row is not None:
            row.append(t)
        elif t.type == "tr_close":
            tables[-1].append(row)
            row = None
    per_class = next(tab for tab in tables if _inline_text(tab[0][0]) == "class")
    assert len(per_class) == 1 + c
    assert all(len(r) == 5 for r in per_class), [len(r) for r in per_class]  # class | precision | recall | F1 | support
    assert sorted(_inline_text(r[0]) for r in per_class[1:]) == sorted(names)  # each name back, exactly
    for r in per_class[1:]:
        assert not AUTOLINK.search(r[0].content), r[0].content
    assert "<script" not in md


def test_model_card_lists_hostile_class_names_unambiguously(ckpt, tmp_path):
    from markdown_it import MarkdownIt

    src = torch.load(ckpt, map_location="cpu", weights_only=True)
    src["class_names"] = HOSTILE
    path = tmp_path / "hostile_names" / "checkpoints" / "epoch_000.ckpt"
    path.parent.mkdir(parents=True)
    torch.save(src, path)
    out = export(export_cfg(tmp_path, path, "timm", tmp_path / "vit"))
    card = (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["label_names"] == HOSTILE
    assert "<script" not in card.lower()  # not even inside a code block
    tokens = MarkdownIt("commonmark").enable("table").parse(card)
    outside_code = [t for t in tokens if t.type == "inline"]
    for t in outside_code:  # no class name is rendered as markup, or anywhere but its list
        assert "evil" not in t.content, t.content
        assert all(c.type != "link_open" for c in t.children or []), t.content
    blocks = [t for t in tokens if t.type == "fence" and t.info == "json"]
    assert len(blocks) == 1 and json.loads(blocks[0].content) == HOSTILE  # in index order, each name exactly

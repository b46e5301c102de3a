"""What a command writes never replaces what it reads, is checked writable before the work, and a full
disk names the file: export, predict, visualize, eval and make_shards through run_cli (as the scripts call
them) and scripts' run directories through the command line check (vitpipe.run.outputs)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import tiny_checkpoints as tc
from conftest import CONF, make_cfg
from user_shell import fresh_checkout, run

from vitpipe.run.files import DiskFullError
from vitpipe.tasks.cli import EXIT_CONFIG, EXIT_DISK_FULL, command_line_mistake, disk_full_message, run_cli
from vitpipe.tasks.evaluate import evaluate
from vitpipe.tasks.export import export
from vitpipe.tasks.make_shards import make_shards_from_config
from vitpipe.tasks.predict import predict
from vitpipe.tasks.visualize import visualize

RUN_FILES = {"metrics.json": "{\"test/acc\": 0.5}\n", "config.yaml": "seed: 1\n", "predictions.csv": "index\n0\n",
             "report/report.md": "# report\n", ".hydra/config.yaml": "seed: 1\n"}


@pytest.fixture(scope="session")
def source_ckpt(tmp_path_factory):
    return tc.checkpoint("sincos2d", tmp_path_factory.mktemp("ckpts"))


@pytest.fixture
def trained(source_ckpt, tmp_path):
    """A copy of a run directory as training leaves it: checkpoints/, metrics.json, config.yaml, report/."""
    run_dir = tmp_path / "t" / "run"  # make_cfg(tmp_path / "t") gives a config whose run dir it is
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(source_ckpt, run_dir / "checkpoints" / "epoch_000.ckpt")
    shutil.copy(source_ckpt, run_dir / "checkpoints" / "last.ckpt")
    for name, text in RUN_FILES.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return run_dir


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(fn, cfg, capsys) -> str:
    """Run ``fn`` as its script does; assert exit status 2 and one ``vitpipe: error:`` line; return it."""
    with pytest.raises(SystemExit) as stop:
        run_cli(fn, cfg)
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.strip()]
    assert stop.value.code == EXIT_CONFIG, err
    assert len(err) == 1 and err[0].startswith("vitpipe: error: "), err
    return err[0]


def no_loading(monkeypatch):
    """Any checkpoint read fails the test: the refusal must come before the work."""
    def fail(*a, **k):
        raise AssertionError("the checkpoint was read before the output was checked")

    import vitpipe.run.stored as ck

    monkeypatch.setattr(ck, "load_checkpoint", fail)


# ---- item 1: no output is, contains or lies inside what the command reads ------------------------------


@pytest.mark.parametrize("where, relation", [("run", "is the run"), ("run/checkpoints", "lies inside the run"),
                                             ("parent", "contains the run"), ("run/export", "lies inside the run")])
def test_export_refuses_an_out_overlapping_the_run_and_the_run_stays_whole(trained, tmp_path, capsys, monkeypatch,
                                                                           where, relation):
    out = {"run": trained, "run/checkpoints": trained / "checkpoints", "parent": tmp_path,
           "run/export": trained / "export"}[where]
    before = snapshot(trained)
    no_loading(monkeypatch)
    cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", "format=timm", f"out={out}", "overwrite=true"],
                   config_name="export")
    line = refused(export, cfg, capsys)
    assert f"out={out} {relation}" in line and f"ckpt_path={trained}" in line, line
    assert snapshot(trained) == before  # every checkpoint, the config, metrics and report as they were


def test_predict_refuses_to_replace_a_file_of_the_run_but_writes_a_new_file_there(trained, tmp_path, capsys):
    images = tc.write_image_folder(tmp_path / "imgs") / "train"
    before = snapshot(trained)
    cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"images={images}", f"out={trained / 'metrics.json'}",
                                    "device=cpu"], config_name="predict")
    line = refused(predict, cfg, capsys)
    assert "would replace metrics.json in the run" in line, line
    assert snapshot(trained) == before
    cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"images={images}", f"out={trained / 'new.csv'}",
                                    "device=cpu"], config_name="predict")
    assert run_cli(predict, cfg) == trained / "new.csv"  # a new file in the run replaces nothing
    assert len((trained / "new.csv").read_text().splitlines()) == 1 + 6


def test_visualize_refuses_out_in_the_run_or_in_the_image_folder(trained, tmp_path, capsys):
    images = tc.write_image_folder(tmp_path / "imgs") / "train" / "cat"
    before, pictures = snapshot(trained), snapshot(images)
    for out, relation in ((trained, "is the run"), (images / "figs", "lies inside the images")):
        cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"images={images}", f"out={out}", "device=cpu"],
                       config_name="visualize")
        assert f"out={out} {relation}" in refused(visualize, cfg, capsys)
    assert snapshot(trained) == before and snapshot(images) == pictures  # no figure among the images


def test_eval_refuses_its_run_dir_inside_the_run_it_evaluates(trained, tmp_path, capsys):
    """hydra.run.dir=<the run>: eval's metrics.json, config.yaml, report/ would replace the run's (and Hydra
    its .hydra/); checked on the command line before Hydra writes, and again in eval (ckpt_path=last)."""
    for out in (trained, trained / "eval"):
        mistake = command_line_mistake(CONF, "eval", [f"ckpt_path={trained}", f"hydra.run.dir={out}"])
        assert mistake and mistake.startswith(f"hydra.run.dir={out} ") and "the run ckpt_path=" in mistake, mistake
    assert command_line_mistake(CONF, "eval", [f"ckpt_path={trained}", f"hydra.run.dir={tmp_path / 'ev'}"]) is None
    assert command_line_mistake(CONF, "train", [f"ckpt_path={trained}", f"hydra.run.dir={trained}"]) is None  # resume
    cfg = make_cfg(trained.parent, [f"ckpt_path={trained}", "trainer.accelerator=cpu"], config_name="eval")
    assert cfg.paths.output_dir == str(trained)  # as with hydra.run.dir=<the run>
    before = snapshot(trained)
    assert "hydra.run.dir=" in refused(evaluate, cfg, capsys)
    assert snapshot(trained) == before


def test_make_shards_refuses_out_inside_the_image_folder_it_converts(tmp_path, capsys):
    root = tc.write_image_folder(tmp_path / "imgs")
    before = snapshot(root)
    cfg = make_cfg(tmp_path / "x", ["data=imagefolder", f"data.root={root}", f"out={root / 'shards'}"],
                   config_name="make_shards")
    assert f"out={root / 'shards'} lies inside the data data.root={root}" in refused(make_shards_from_config, cfg, capsys)
    assert snapshot(root) == before


# ---- item 8: outputs that cannot be written: refused before the work ------------------------------------


def test_outputs_under_a_file_are_one_line_before_anything_is_read(trained, tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    no_loading(monkeypatch)
    for fmt, out in (("timm", blocker / "vit"), ("onnx", blocker / "vit.onnx")):
        cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"format={fmt}", f"out={out}"], config_name="export")
        assert f"out={out}: {blocker} is a file, not a folder" in refused(export, cfg, capsys)
    for out, expected in ((blocker, f"out={blocker} is a file, not a folder"),
                          (blocker / "shards", f"{blocker} is a file, not a folder")):
        cfg = make_cfg(tmp_path / "x", [f"out={out}"], config_name="make_shards")
        assert expected in refused(make_shards_from_config, cfg, capsys)
    assert blocker.read_text() == "x"


def test_run_dir_under_a_file_or_with_a_name_too_long_is_one_line_before_hydra_makes_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert command_line_mistake(CONF, "train", [f"hydra.run.dir={blocker}/run"]) == (
        f"hydra.run.dir={blocker}/run: {blocker} is a file, not a folder; pass hydra.run.dir=<a path in a folder "
        "you can write to>")
    long = "t" * 300
    assert command_line_mistake(CONF, "train", [f"task_name={long}", f"paths.log_dir={tmp_path}"]).startswith(
        f"task_name={long[:24]}... is 300 bytes, and it names the run's folder, which may have at most 255")
    assert "is 300 bytes, longer than the 255" in command_line_mistake(CONF, "eval", ["ckpt_path=x",
                                                                                      f"hydra.run.dir={tmp_path / long}"])
    assert not (tmp_path / "run").exists()


def test_disk_full_message_suggests_a_resume_only_where_a_checkpoint_is_saved(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    nothing = disk_full_message(DiskFullError(28, ckpts / "epoch_000.ckpt"))
    assert f"writing {ckpts / 'epoch_000.ckpt'}" in nothing and "nothing to resume" in nothing
    assert "ckpt_path" not in nothing
    export_file = disk_full_message(DiskFullError(28, tmp_path / "vit" / "model.safetensors"))
    assert f"writing {tmp_path / 'vit' / 'model.safetensors'}" in export_file and "ckpt_path" not in export_file
    (ckpts / "epoch_000.ckpt").write_bytes(b"x")
    saved = disk_full_message(DiskFullError(28, ckpts / "last.ckpt"))
    assert "earlier checkpoints are intact" in saved and f"ckpt_path={tmp_path / 'run'}" in saved


@contextmanager
def mounted_tmpfs(where: Path, *options: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)], capture_output=True,
                       text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {m.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_read_only_outputs_are_one_line_before_the_export(trained, tmp_path, capsys, monkeypatch):
    with mounted_tmpfs(tmp_path / "ro", "ro", "size=64k") as ro:
        assert command_line_mistake(CONF, "train", [f"hydra.run.dir={ro / 'run'}"]) == (
            f"hydra.run.dir={ro / 'run'}: cannot write in {ro} (Read-only file system); pass hydra.run.dir=<a path "
            "in a folder you can write to>")
        no_loading(monkeypatch)  # ONNX used to fail only after the whole export
        for fmt, out in (("onnx", ro / "vit.onnx"), ("timm", ro / "vit")):
            cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"format={fmt}", f"out={out}"],
                           config_name="export")
            assert f"out={out}: cannot write in {ro} (Read-only file system)" in refused(export, cfg, capsys)
        cfg = make_cfg(tmp_path / "x", [f"out={ro / 'shards'}"], config_name="make_shards")
        assert "(Read-only file system)" in refused(make_shards_from_config, cfg, capsys)


def full_disk_export(trained, tmp_path, capsys, fmt: str, name: str) -> None:
    """safetensors reports ENOSPC as a SafetensorError (no OSError): exit 74 naming the file written, not a
    traceback; no ckpt_path advice (there is nothing to resume); the tmpfs holds nothing afterwards."""
    with mounted_tmpfs(tmp_path / "small", "size=32k") as small:
        filler = small / "filler"
        filler.write_bytes(b"\0" * (20 * 1024))  # 12 KiB left: the writability probe fits, the weights do not
        cfg = make_cfg(tmp_path / "x", [f"ckpt_path={trained}", f"format={fmt}", f"out={small / name}"],
                       config_name="export")
        with pytest.raises(SystemExit) as stop:
            run_cli(export, cfg)
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vitpipe:")]
        assert stop.value.code == EXIT_DISK_FULL, err
        written = small / name / "model.safetensors" if fmt == "timm" else small / name
        assert len(err) == 1 and f"No space left on device writing {written}" in err[0], err
        assert "ckpt_path" not in err[0]
        assert [p.name for p in small.iterdir()] == ["filler"]
        filler.write_bytes(b"\0" * (32 * 1024))  # full: a run directory there is refused before Hydra makes it
        assert command_line_mistake(CONF, "train", [f"hydra.run.dir={small / 'run'}"]) == (
            f"hydra.run.dir={small / 'run'}: cannot write in {small} (no space left on device); "
            "pass hydra.run.dir=<a path in a folder you can write to>")


def test_full_disk_timm_export_names_model_safetensors_in_one_line(trained, tmp_path, capsys):
    full_disk_export(trained, tmp_path, capsys, "timm", "vit")


@pytest.mark.slow  # the ONNX exporter takes ~15 s on a loaded 2-core machine
def test_full_disk_onnx_export_names_the_file_in_one_line(trained, tmp_path, capsys):
    full_disk_export(trained, tmp_path, capsys, "onnx", "vit.onnx")


# ---- item 12a: what killed writers left is removed at the next start ----------------------------------


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_eval_removes_what_a_killed_eval_left_in_its_run_dir(trained, tmp_path):
    out = tmp_path / "eval" / "run"  # make_cfg's run dir
    (out / "report").mkdir(parents=True)
    host = socket.gethostname()
    stale = [out / f".predictions.csv.tmp-{host}-{dead_pid()}-abc123", out / "report" / f".errors.png.tmp-{host}-"
             f"{dead_pid()}-x_1"]
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        kept = [out / f".metrics.json.tmp-{host}-{live_writer.pid}-q9", out / ".notes.tmp-mine"]  # a live save; not ours
        for p in stale + kept:
            p.write_text("half")
        cfg = make_cfg(out.parent, [f"ckpt_path={trained}", "trainer.accelerator=cpu", "++trainer.limit_test_batches=1"],
                       config_name="eval")
        assert cfg.paths.output_dir == str(out)  # hydra.run.dir=<the killed eval's run dir>
        run_cli(evaluate, cfg)
        assert (out / "predictions.csv").is_file()
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in kept)
    finally:
        live_writer.send_signal(signal.SIGKILL)
        live_writer.wait()


# ---- through the command line, as typed ---------------------------------------------------------------


@pytest.mark.slow  # one script start-up (~10 s on a loaded 2-core machine)
def test_export_into_the_run_as_typed_is_refused_and_the_run_stays_whole(trained, tmp_path):
    cwd = fresh_checkout(tmp_path / "w")
    before = snapshot(trained)
    r = run(f"python scripts/export.py ckpt_path={trained} format=timm out={trained} overwrite=true", cwd, timeout=300)
    assert r.returncode == EXIT_CONFIG, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"vitpipe: error: out={trained} is the run ckpt_path={trained} reads ({trained}); an output may not replace "
        "or remove what the command reads: choose another out="]
    assert snapshot(trained) == before

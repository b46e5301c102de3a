"""``vitpipe <command>`` itself (vitpipe/__main__.py, vitpipe/commands.py, vitpipe/config/shipped.py): the
overview, an unknown command, ``vitpipe cp`` and the ``--config-dir`` guard, in-process; ``python -m vitpipe``
once through a subprocess. The installed wheel's console script, run from outside a checkout, and a
``--config-dir`` that composes: tests/test_install.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from user_shell import ROOT, user_env

from vitpipe.__main__ import main, overview
from vitpipe.commands import COMMANDS
from vitpipe.config.shipped import names
from vitpipe.tasks.cli import EXIT_CONFIG


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_python_m_vitpipe_help_lists_every_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vitpipe", "--help"], cwd=tmp_path, env=user_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == overview()
    listed = [ln.split()[0] for ln in out.stdout.splitlines() if ln.startswith("  ")]
    assert listed == [*COMMANDS, "cp"]


@pytest.mark.parametrize("argv", [[], ["-h"], ["help"]])
def test_no_command_or_help_prints_the_overview(argv, capsys):
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == overview()


def test_an_unknown_command_is_one_line_with_exit_2(capsys):
    assert main(["trian", "model=vit_s4"]) == 2
    out, err = capsys.readouterr()
    assert not out
    assert one_line(err).startswith("vitpipe: error: trian is not a vitpipe command; did you mean train?")


def test_cp_copies_a_shipped_config_and_never_replaces_a_file(tmp_path, capsys):
    dest = tmp_path / "my_conf" / "model" / "my_vit.yaml"
    assert main(["cp", "model/vit_s4", str(dest)]) == 0
    assert dest.read_text() == (ROOT / "conf" / "model" / "vit_s4.yaml").read_text()
    assert str(dest) in capsys.readouterr().out

    dest.write_text("mine: 1\n")  # the user's edit
    assert main(["cp", "model/vit_s4.yaml", str(dest)]) == 2
    assert "never replaces a file" in one_line(capsys.readouterr().err)
    assert dest.read_text() == "mine: 1\n"

    # a folder keeps the file's name; made if missing
    assert main(["cp", "train", str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "train.yaml").read_text() == (ROOT / "conf" / "train.yaml").read_text()


@pytest.mark.parametrize(("argv", "says"), [
    (["cp", "model/vit_s5", "x.yaml"], "model/vit_s5 is not a shipped config; did you mean model/vit_s4?"),
    (["cp", "model/vit_s4"], "vitpipe cp takes <config> <dest>"),
    (["cp", "model/vit_s4", "a.yaml", "b.yaml"], "vitpipe cp takes <config> <dest>"),
])
def test_cp_mistakes_are_one_line_with_exit_2(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert says in one_line(capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_every_shipped_config_is_named_as_hydra_knows_it():
    shipped = names()
    assert {"train", "predict", "model/vit_s4", "hydra/launcher/slurm"} <= set(shipped)
    assert len(shipped) == len(list((ROOT / "conf").rglob("*.yaml")))


def test_config_dir_with_a_shipped_name_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Hydra searches --config-dir after the shipped configs: a model/vit_s4.yaml there would be passed over."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "my_conf" / "model"
    mine.mkdir(parents=True)
    (mine / "vit_s4.yaml").write_text("defaults: [vit]\nname: vit_s4\ndepth: 3\n")
    (mine / "my_vit.yaml").write_text("defaults: [vit]\nname: my_vit\n")  # a name of its own: fine
    with pytest.raises(SystemExit) as stop:
        main(["train", "--config-dir", "my_conf", "model=vit_s4"])
    assert stop.value.code == EXIT_CONFIG
    err = one_line(capsys.readouterr().err)
    assert err.startswith("vitpipe: error: --config-dir my_conf: model/vit_s4.yaml named like a shipped config")
    assert "my_vit" in err  # says what to do
    assert not (tmp_path / "logs").exists()


def test_an_argparse_command_names_itself_in_its_usage(capsys):
    """`vitpipe make_teacher --help` shows the command line to type, not `usage: vitpipe run out`."""
    with pytest.raises(SystemExit) as stop:
        main(["make_teacher", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vitpipe make_teacher ")
    with pytest.raises(SystemExit) as stop:
        main(["make_teacher"])
    assert stop.value.code == 2
    assert "vitpipe make_teacher: error:" in capsys.readouterr().err
    assert not sys.argv[0].startswith("vitpipe ")  # restored

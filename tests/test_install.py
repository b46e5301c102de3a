"""vitpipe as a user installs it: a wheel (``pip install .``, not editable) in a fresh venv, its commands run
from a directory that is not a checkout.

The wheel is built from a copy of the package's files (what ``pip install .`` builds from), so the checkout
gets no ``build/`` or ``*.egg-info`` and no stale ``build/lib`` can leak into it. Building it and reading
its file list takes ~2 s (~5 s where pip builds in an isolated env) and stays in the default suite;
installing and running it is marked slow (``.ci/run``: ``python -m pytest -q -m slow tests/test_install.py``).

How the fresh venv gets torch & co.: (b), a real install. Measured on the 2-core AMD EPYC (pip's cache
empty, other test suites running: load 1.5-4):
(b) ``python -m venv`` + ``pip install <wheel>``, every dependency resolved from the configured indexes
    (torch 2.14.1+cu130 and its CUDA wheels, 6.1 GB): 93 s alone; in this test with ``--no-compile`` 47-87 s
    (170 s byte-compiling, at load 4). Chosen: under the ~4 min budget, and the only way to check that
    ``[project] dependencies`` alone make the commands run (the dev venv holds every extra too). It needs
    the package index ``.ci/run``'s own install uses.
(a) ``python -m venv --without-pip``, ``pip --python <venv> install --no-deps <wheel>``, and the running
    venv's site-packages appended by a ``.pth`` (its own ``.pth`` files, the editable finder among them, are
    then not run, so the installed copy imports): ~1 s, but it checks nothing about dependencies.
The slow module took 2 min 10 s at load 1.6 (install 47 s, the commands 72 s, removing the 6 GB venv 4 s)
and 4 min 44 s at load 3.5 (87 s, 130 s, 68 s).
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from user_shell import ROOT, SHORT_TRAIN, run_dir_of

SOURCES = ("pyproject.toml", "README.md", "vitpipe", "conf", "hydra_plugins")   # what the wheel is built from
TOP_LEVEL = {"vitpipe", "hydra_plugins"}


def build_flags() -> list[str]:
    """``--no-build-isolation`` (offline, ~1 s) when this venv has what ``[build-system] requires``; else none:
    pip builds in an isolated env from the index, as ``pip install .`` does (a venv from Python 3.11's
    ``python -m venv``, such as ``.ci/run``'s, holds setuptools 66, older than the >=77 the build needs)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        import tomllib
        from packaging.requirements import Requirement
    except ImportError:  # Python 3.10, or no packaging
        return []
    for spec in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]:
        req = Requirement(spec)
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                return []
        except PackageNotFoundError:
            return []
    return ["--no-build-isolation", "--no-index"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, pip's build log)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            # symlinks=True keeps vitpipe/conf -> ../conf a link into the copy's conf/, as in a checkout
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *build_flags(), str(src), "-w", str(tmp / "dist")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("vitpipe-*.whl")
    return built, out.stdout + out.stderr


def test_the_wheel_ships_every_config_and_no_weights_tests_or_scripts(wheel):
    built, log = wheel
    names = zipfile.ZipFile(built).namelist()
    shipped = {n.removeprefix("vitpipe/conf/") for n in names if n.startswith("vitpipe/conf/") and n.endswith(".yaml")}
    configs = {p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert shipped == configs, f"missing: {sorted(configs - shipped)}; extra: {sorted(shipped - configs)}"
    assert "vitpipe/conf/__init__.py" in names  # Hydra's pkg:// source imports vitpipe.conf
    assert "vitpipe/__main__.py" in names and "vitpipe/commands.py" in names
    top = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert top == TOP_LEVEL, f"top-level entries besides the packages: {sorted(top - TOP_LEVEL)}"
    conf_other = [n for n in names if n.startswith("vitpipe/conf/") and not n.endswith((".yaml", "/__init__.py"))]
    assert not conf_other, f"conf/ holds configs only, the wheel carries: {conf_other}"
    heavy = [n for n in names if n.endswith((".safetensors", ".ckpt", ".pt", ".pth", ".onnx", ".npz", ".png"))]
    assert not heavy, f"weights or data in the wheel (they live in assets/, docs/install.md): {heavy}"
    entry = zipfile.ZipFile(built).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "vitpipe = vitpipe.__main__:main" in entry
    # setuptools' "Package 'vitpipe.conf.model' ... would be ignored" (conf's folders read as packages), or any
    # other build warning (a deprecated pyproject field): the packaging config is stated the way setuptools wants
    for warning in ("would be ignored", "BuildBackendWarning", "SetuptoolsDeprecationWarning"):
        assert warning not in log, log[-4000:]


# ---- installed, from a directory outside the checkout (slow) -------------------------------------------------

def _env(**extra: str) -> dict[str, str]:
    """The user's environment: no PYTHONPATH (the checkout, carried wheels) and no pytest markers."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_CURRENT_TEST", "PYTHONHOME")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONNOUSERSITE": "1", **extra}


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed as a user does (non-editable, with its dependencies: (b) above)."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=300, env=_env())
    # --no-compile: byte-compiling torch & co. is most of pip's CPU time here, and nothing this tests
    out = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", str(wheel[0])],
                         capture_output=True, text=True, timeout=900, env=_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    yield root
    shutil.rmtree(root, ignore_errors=True)  # 6 GB: pytest keeps the last three runs' tmp folders


def vitpipe(venv: Path, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``vitpipe <args>`` as typed in a shell with the fresh venv activated."""
    env = _env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    exe = shutil.which("vitpipe", path=env["PATH"])
    assert exe == str(venv / "bin" / "vitpipe"), exe
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow
def test_the_venv_imports_the_wheel_not_the_checkout(venv, tmp_path):
    probe = ("import importlib.metadata as m, pathlib, sys, vitpipe, vitpipe.conf, vitpipe.commands; "
             "print(vitpipe.__file__); print(pathlib.Path(vitpipe.conf.__file__).parent.is_symlink()); "
             "print(m.distribution('vitpipe').read_text('direct_url.json') or ''); "
             "print(any('editable' in type(f).__name__.lower() for f in sys.meta_path))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    where, conf_is_link, direct_url, editable_finder = _ok(out).splitlines()[:4]
    assert Path(where).resolve().is_relative_to(venv.resolve()), where
    assert not Path(where).resolve().is_relative_to(ROOT), where
    assert conf_is_link == "False"  # the wheel carries conf/ as files, not the checkout's link
    assert '"editable": true' not in direct_url
    assert editable_finder == "False", "the running venv's editable finder was installed in the fresh venv"


@pytest.mark.slow
def test_help_then_the_default_train_then_predict_from_outside_the_checkout(venv, tmp_path):
    help_text = _ok(vitpipe(venv, "--help", cwd=tmp_path))
    assert "train" in help_text and "predict" in help_text and "cp" in help_text
    # the README's first run (`python scripts/train.py`), as `vitpipe train`, with the tests' shortening only
    train = vitpipe(venv, "train", *SHORT_TRAIN, cwd=tmp_path)
    run = run_dir_of(_ok(train))
    assert run.is_relative_to(tmp_path / "logs" / "train"), run  # the run goes where the command was started
    assert not (ROOT / "logs" / "train" / "runs" / run.name).exists()

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = tmp_path / "digits_png"
    images.mkdir()
    for i in range(5):
        Image.fromarray((digits.images[-1 - i] * 255 / 16).astype("uint8")).save(images / f"{i:02d}.png")
    _ok(vitpipe(venv, "predict", f"ckpt_path={run}", f"images={images}", "out=preds.csv", "topk=10", cwd=tmp_path))
    with open(tmp_path / "preds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(Path(r["path"]).name for r in rows) == [f"{i:02d}.png" for i in range(5)]
    for r in rows:
        probs = [float(r["prob"])] + [float(r[f"top{k}_prob"]) for k in range(2, 11)]  # all 10 digit classes
        assert abs(sum(probs) - 1) < 1e-4, r


@pytest.mark.slow
def test_cp_a_shipped_model_then_train_with_config_dir_composes_it(venv, tmp_path):
    out = _ok(vitpipe(venv, "cp", "model/vit_s4", "my_conf/model/my_vit.yaml", cwd=tmp_path))
    copied = tmp_path / "my_conf" / "model" / "my_vit.yaml"
    assert str(copied.relative_to(tmp_path)) in out
    assert copied.read_text() == (ROOT / "conf" / "model" / "vit_s4.yaml").read_text()
    # edit it as a user would; Hydra's own --cfg job prints the composed config and runs nothing
    copied.write_text(copied.read_text() + "depth: 3\n")
    job = _ok(vitpipe(venv, "train", "--config-dir", "my_conf", "model=my_vit", "--cfg", "job", cwd=tmp_path))
    assert "name: vit_s4" in job and "depth: 3" in job, job[-3000:]
    assert not (tmp_path / "logs").exists()

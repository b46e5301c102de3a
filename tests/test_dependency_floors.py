"""pyproject.toml's dependency floors: the installed releases satisfy them, and every floor kept for an API
equals the one recorded here beside a probe of that API, run against the installed release.

What the fast tests catch: an environment below a floor, a floor edited away from the release its API arrived
in (e.g. lightning>=2.5 again: Trainer.fit(weights_only=) is 2.6), and a newer release that dropped the API.
Passing against the installed release says nothing about the floor itself: the slow test installs each probed
floor release from PyPI into a venv of its own and runs its probe there (-m slow; needs pip to reach PyPI).
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> tuple[list[Requirement], dict[str, list[Requirement]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    return [Requirement(r) for r in project["dependencies"]], extras


def _floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{req}: state one floor (>=X)"
    return floors[0]


# ---- the APIs floors exist for: probes of the installed release ----------------------------------------


def _lightning(tmp_path):
    from lightning.pytorch import Trainer

    for fn in (Trainer.fit, Trainer.test):  # vitpipe.tasks.train passes weights_only=True to both
        assert "weights_only" in inspect.signature(fn).parameters, fn.__qualname__


def _timm(tmp_path):
    import timm
    from timm.models import save_for_hf

    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16, depth=1,
                           num_heads=2, num_classes=3)  # fmt: skip
    save_for_hf(tm, str(tmp_path), safe_serialization=True)  # as vitpipe.export.timm_format does: no model_args=
    assert json.loads((tmp_path / "config.json").read_text()).get("model_args", {}).get("embed_dim") == 16
    assert timm.create_model(f"local-dir:{tmp_path}", pretrained=True).embed_dim == 16


def _torch(tmp_path):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401  (vitpipe.benchmark.common)

    assert callable(torch.nn.Module.compile) and torch.amp.GradScaler  # module.compile=true; vitpipe.benchmark.common
    params = inspect.signature(torch.load).parameters
    assert {"weights_only", "mmap"} <= set(params)  # vitpipe.run.checkpoint reads with both


def _torch_onnx(tmp_path):
    import torch

    export = inspect.signature(torch.onnx.export).parameters  # vitpipe.export.onnx_format
    assert {"dynamo", "dynamic_shapes"} <= set(export) and export["f"].default is None


def _torchvision(tmp_path):
    from torchvision.transforms import v2

    assert v2.RGB and v2.ToImage and v2.ToDtype  # vitpipe.data.transforms


def _hydra(tmp_path):
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):  # vitpipe.tasks.cli
        pass


def _wandb(tmp_path):
    from wandb.sdk import wandb_setup

    # vitpipe.config.checks.check_wandb_login looks at wandb's settings through these, without wandb.setup()
    assert hasattr(wandb_setup, "_singleton")
    assert "pid" in inspect.signature(wandb_setup._WandbSetup).parameters


def _litdata(tmp_path):
    from litdata.utilities.format import _convert_bytes_to_int

    assert _convert_bytes_to_int("600B") == 600  # shard_size in bytes (BinaryWriter's chunk_bytes)


def _onnxscript(tmp_path):
    import importlib

    import torch

    if Version(torch.__version__.split("+")[0]) >= Version("2.11"):  # what torch >= 2.11's ONNX exporter imports
        importlib.import_module("onnxscript._framework_apis.torch_2_11")


def _peft(tmp_path):
    import peft
    from torch import nn

    net = peft.inject_adapter_in_model(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["0"], bias="none"),
                                       nn.Sequential(nn.Linear(4, 4)), adapter_name="default")
    assert {"0.base_layer.weight", "0.lora_A.default.weight"} <= set(net.state_dict())  # 0.6: 0.weight
    net[0].merge(safe_merge=True)
    assert isinstance(net[0].get_base_layer(), nn.Linear)


# (distribution, the list holding it, its floor, what needs that release, probe). What only runs can show (ONNX
# export at torch 2.7 stops in torch.export, rope2d's graph needs onnxscript 0.7.2 and onnxruntime 1.29) is
# exercised by tests/test_export.py's ONNX tests.
FLOORS = [
    ("lightning", "dependencies", "2.6", "Trainer.fit/test(weights_only=)", _lightning),
    ("timm", "dependencies", "1.0.31", "save_for_hf recording create_model's arguments, read back by local-dir:", _timm),
    ("torch", "dependencies", "2.5", "the suite at 2.5.1 (nn.Module.compile, sdpa_kernel, load(mmap=))", _torch),
    ("torch", "export", "2.8", "ONNX export with a dynamic batch (2.7: torch.export's batch guard)", _torch_onnx),
    ("torchvision", "dependencies", "0.20", "the build for torch 2.5; transforms.v2.RGB", _torchvision),
    ("hydra-core", "dependencies", "1.3", 'version_base="1.3"', _hydra),
    ("wandb", "dependencies", "0.19.2", "wandb_setup._singleton and _WandbSetup(pid=)", _wandb),
    ("litdata", "dependencies", "0.2.71", 'chunk sizes in bytes ("600B")', _litdata),
    ("onnxscript", "export", "0.7.2", "rope2d's ONNX conversion; the torch_2_11 API", _onnxscript),
    ("onnxruntime", "export", "1.29", "Cos on float64 (rope2d's ONNX graph)", None),
    ("peft", "lora", "0.7", "inject_adapter_in_model with the base_layer key layout (vitpipe/models/lora.py)", _peft),
]


def test_installed_releases_satisfy_every_floor():
    core, extras = _pyproject()
    below, missing = [], []
    for req, required in [(r, True) for r in core] + [(r, False) for reqs in extras.values() for r in reqs]:
        try:
            installed = md.version(req.name)
        except md.PackageNotFoundError:
            if required:
                missing.append(req.name)
            continue  # an extra this environment did not install (dev installs them all)
        if not req.specifier.contains(installed, prereleases=True):
            below.append(f"{req.name} {installed} (pyproject: {req})")
    assert not missing, f"dependencies not installed: {missing}"
    assert not below, f"installed releases outside pyproject.toml's floors: {below}"


def _lists() -> dict[str, dict[str, Requirement]]:
    core, extras = _pyproject()
    return {"dependencies": {r.name: r for r in core}, **{k: {r.name: r for r in v} for k, v in extras.items()}}


@pytest.mark.parametrize("dist, where, recorded, why, probe", FLOORS, ids=[f"{d}[{w}]" for d, w, *_ in FLOORS])
def test_each_floor_is_the_release_its_api_arrived_in(dist, where, recorded, why, probe, tmp_path):
    req = _lists()[where][dist]
    assert _floor(req) == Version(recorded), (
        f"pyproject.toml's {where} has {req}, but {why} needs {dist}>={recorded} (tests/test_dependency_floors.py); "
        "change both together, with how the new floor was checked")
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed (an extra)")
    if probe is not None:
        probe(tmp_path)


def test_dev_repeats_every_extra_with_its_floor():
    """CI installs .[dev]: each extra's requirement is in dev too, with the same floor, and no extra lowers a
    floor of the dependencies."""
    lists = _lists()
    dev, core = lists.pop("dev"), lists.pop("dependencies")
    for extra, reqs in lists.items():
        for name, req in reqs.items():
            assert name in dev and dev[name].specifier == req.specifier, f"[{extra}] {req} vs dev {dev.get(name)}"
            if name in core:
                assert _floor(req) >= _floor(core[name]), f"[{extra}] {req} is below the dependency {core[name]}"


# ---- each probe against the floor release itself (slow: pip installs from PyPI) ---------------------------
# Each probed floor goes (--no-deps) into a fresh venv; the other dependencies are borrowed from this venv
# through a .pth, which site processes after adding the venv's own site-packages, so the floor release comes
# first on sys.path and is the one the probe imports (tests/tools/floor_probe.py checks that it is). Where the
# floor's own requirements exclude a borrowed release (wandb 0.19.2: protobuf<6), the venv gets the newest
# release they allow too, as pip would resolve it: a user at the floor never has the excluded one.

# Not on this machine's disk: the torch wheels here are 2.13.0 and 2.14.1 (pip's constraint file caps torch
# there), and a torch floor needs its own torchvision build beside it. pyproject.toml records those runs.
NOT_INSTALLABLE = {
    "torch": "torch floors (2.5, 2.8) are not installable here: only torch 2.13.0/2.14.1 wheels are on disk",
    "torchvision": "torchvision 0.20 needs torch 2.5 beside it, which is not installable here",
}
PROBED = [row for row in FLOORS if row[4] is not None]
PROBE_SCRIPT = ROOT / "tests" / "tools" / "floor_probe.py"


def _unmet_requirements(floor: md.Distribution) -> list[str]:
    """The floor release's requirements that this venv's releases do not satisfy (or lack), markers applied."""
    unmet = []
    for req in map(Requirement, floor.requires or ()):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            unmet.append(f"{req.name}{req.specifier}")
    return unmet


def _pip_install(python: Path, *reqs: str) -> None:
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--only-binary=:all:", "--quiet", *reqs], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert pip.returncode == 0, f"pip install {' '.join(reqs)} into {python}:\n{pip.stderr[-3000:]}"


def make_release_venv(venv: Path, dist: str, version: str) -> Path:
    """A venv at `venv` holding dist==version (and what its requirements exclude here), the rest borrowed from
    this venv; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _pip_install(python, f"{dist}=={version}")
    site = subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()  # fmt: skip
    unmet = _unmet_requirements(next(md.distributions(name=dist, path=[site])))
    if unmet:
        _pip_install(python, *unmet)
    # written after the installs, or pip would take the borrowed newer release for the installed one
    borrowed = sysconfig.get_path("purelib")
    (Path(site) / "zz_borrowed_site_packages.pth").write_text(f"import site; site.addsitedir({borrowed!r})\n")
    return python


def run_probe(python: Path, dist: str, probe, workdir: Path) -> subprocess.CompletedProcess:
    """Run `probe` of this file under `python` (tests/tools/floor_probe.py); its last stdout line is JSON."""
    return subprocess.run([str(python), "-I", str(PROBE_SCRIPT), dist, probe.__name__, str(workdir)], cwd=workdir,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="session")
def floor_venv(tmp_path_factory):
    """make(dist, version) -> the python of make_release_venv's venv for that release, made once a session."""
    made: dict[tuple[str, str], Path] = {}

    def make(dist: str, version: str) -> Path:
        if (dist, version) not in made:
            made[dist, version] = make_release_venv(tmp_path_factory.mktemp(f"floor-{dist}-{version}"), dist, version)
        return made[dist, version]

    return make


@pytest.mark.slow
@pytest.mark.parametrize("dist, where, recorded, why, probe", PROBED, ids=[f"{d}[{w}]" for d, w, *_ in PROBED])
def test_probe_passes_at_its_floor(dist, where, recorded, why, probe, floor_venv, tmp_path):
    if dist in NOT_INSTALLABLE:
        pytest.skip(NOT_INSTALLABLE[dist])
    python = floor_venv(dist, recorded)
    run = run_probe(python, dist, probe, tmp_path)
    assert run.returncode == 0, (
        f"{probe.__name__} fails at {dist}=={recorded}, so {why} needs a later release than pyproject.toml's {where} "
        f"floor: find the lowest release it passes at and change both\n{run.stderr[-3000:]}")
    ran = json.loads(run.stdout.strip().splitlines()[-1])
    assert Version(ran["version"]) == Version(recorded), f"the venv holds {dist} {ran['version']}, not the floor"
    venv = python.parent.parent.resolve()
    outside = {top: f for top, f in ran["imported"].items() if f and not Path(f).resolve().is_relative_to(venv)}
    assert ran["imported"] and not outside, f"the probe imported {dist} from outside the floor venv: {outside}"

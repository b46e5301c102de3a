"""The package's layers: no import (module level or inside a function) runs from a lower layer to a
higher one, and scripts/*.py are thin wrappers over vitpipe.tasks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# low to high; a module may import its own layer and those below it
LAYERS = [
    ("vitpipe.errors", "vitpipe.run.files", "vitpipe.run.safeload",   # every layer: the mistake, writing files, safe loads,
     "vitpipe.run.jsonfiles"),                                         # reading handed JSON
    ("vitpipe.nn",),                                  # building blocks: attention, positions, patches
    ("vitpipe.models", "vitpipe.text", "vitpipe.metrics"),
    ("vitpipe.kinds",),                               # task kinds: multi-class, multi-label, captioning, MAE
    ("vitpipe.data",),
    ("vitpipe.config",),                              # checks and instantiation of a composed config
    ("vitpipe.run",),                                 # run directories, checkpoints, run files
    ("vitpipe.lit",),                                 # LightningModules and callbacks
    ("vitpipe.report", "vitpipe.viz", "vitpipe.export", "vitpipe.sweep",
     "vitpipe.inference"),                            # inference on a stored run: predict, serve, demo, visualize, export
    ("vitpipe.tasks", "vitpipe.benchmark"),           # the bodies of scripts/*.py; the benchmark package
]


def layer_of(module: str) -> int | None:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    return None if best is None else best[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in found if m.startswith("vitpipe.")]


MODULES = sorted(p for p in (ROOT / "vitpipe").rglob("*.py") if p != ROOT / "vitpipe" / "__init__.py")


def test_every_module_has_a_layer():
    assert [m for m in map(_module_name, MODULES) if layer_of(m) is None] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_up_the_layers(path):
    me = layer_of(_module_name(path))
    upward = sorted({m for m in _imports(path) if (layer_of(m) or 0) > me})
    assert upward == [], f"{_module_name(path)} (layer {me}) imports from higher layers: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    # the rule can fail: a data module importing a Lightning module is caught
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from vitpipe.lit.classifier import ImageClassifier\n")
    assert layer_of("vitpipe.data.x") < max(layer_of(m) for m in _imports(bad))


@pytest.mark.parametrize("script", sorted((ROOT / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_scripts_are_thin_wrappers_over_tasks(script):
    if script.name == "run_notebooks.py":  # a developer tool: executes the notebooks, imports no vitpipe code
        assert _imports(script) == []
        return
    imported = _imports(script)
    assert imported and all(m.startswith("vitpipe.tasks.") for m in imported), imported
    code_lines = [ln for ln in script.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code_lines) <= 15, f"{script.name}: {len(code_lines)} lines; its body belongs in vitpipe/tasks/"

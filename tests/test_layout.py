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
    ("vitpipe.commands", "vitpipe.__main__"),         # each command defined once: `vitpipe <command>`, scripts/*.py
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
    allowed = ("vitpipe.tasks.", "vitpipe.benchmark.", "vitpipe.commands")  # a body, or the command as `vitpipe` runs it
    assert imported and all(m.startswith(allowed) for m in imported), imported
    code_lines = [ln for ln in script.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code_lines) <= 15, f"{script.name}: {len(code_lines)} lines; its body belongs in vitpipe/tasks/"


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the vitpipe modules it imports (lazy imports inside functions included), for the .py files
    under ``root``; ``from vitpipe.models import ViT`` is an edge to vitpipe.models (its __init__), the longest
    module the name starts with. A package's __init__ is not implicitly a dependency of its submodules:
    Python runs it first, so that order cannot deadlock."""
    files = {_module_name_under(p, root): p for p in sorted(root.rglob("*.py"))}

    def module(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {t for t in map(module, _imports(p)) if t and t != m} for m, p in files.items()}


def _module_name_under(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One readable chain ``a -> b -> a`` per strongly connected component of more than one module
    (Tarjan's algorithm; iterative, so a deep import chain cannot hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    components.append(component)
    return sorted(_shortest_cycle(graph, c) for c in components)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> str:
    # breadth-first from the first module back to itself, inside the component: the shortest chain that shows it
    first = min(component)
    came_from = {first: None}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == first:
                    chain = [v]
                    while came_from[chain[-1]] is not None:
                        chain.append(came_from[chain[-1]])
                    return " -> ".join([*reversed(chain), first])
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {first} in {sorted(component)}")


def test_no_two_modules_import_each_other():
    """No import cycle among vitpipe's modules, lazy imports included: a lazy import only hides a cycle
    from the interpreter until the function runs; the two modules still cannot be read or moved apart."""
    cycles = import_cycles(import_graph(ROOT / "vitpipe"))
    assert cycles == [], "import cycles:\n  " + "\n  ".join(cycles)


def test_the_cycle_checker_sees_a_lazy_cycle(tmp_path):
    # the rule can fail: a -> b at module level, b -> c -> a inside functions, and a separate pair d <-> e
    pkg = tmp_path / "vitpipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from vitpipe.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from vitpipe import c\n")
    (pkg / "c.py").write_text("def g():\n    import vitpipe.a\n")
    (pkg / "d.py").write_text("def h():\n    from vitpipe.e import k\n")
    (pkg / "e.py").write_text("from vitpipe import d\n")
    (pkg / "leaf.py").write_text("import vitpipe.a\n")  # imports into a cycle, is not part of one
    assert import_cycles(import_graph(pkg)) == ["vitpipe.a -> vitpipe.b -> vitpipe.c -> vitpipe.a",
                                                "vitpipe.d -> vitpipe.e -> vitpipe.d"]

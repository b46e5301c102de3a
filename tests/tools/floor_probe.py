"""Run one probe of tests/test_dependency_floors.py in this interpreter and print what it ran against.

Usage: ``python -I tests/tools/floor_probe.py DIST PROBE WORKDIR`` with the interpreter of a floor venv
(tests/test_dependency_floors.py::test_probe_passes_at_its_floor makes one per floor). Prints one JSON line:
the release of DIST that importlib.metadata finds, and the files its imported top-level packages came from,
so the test can tell the probe ran against the floor release and not the newer one borrowed through the .pth.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
import tempfile
from pathlib import Path


def main(dist: str, probe: str, workdir: str) -> None:
    floors = Path(__file__).resolve().parents[1] / "test_dependency_floors.py"
    spec = importlib.util.spec_from_file_location("dependency_floors", floors)  # loaded by path: no sys.path edit
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, probe)(Path(tempfile.mkdtemp(dir=workdir)))

    tops = {f.parts[0] for f in md.distribution(dist).files or () if f.suffix == ".py" and len(f.parts) > 1}
    imported = {t: getattr(sys.modules[t], "__file__", None) for t in sorted(tops) if t in sys.modules}
    print(json.dumps({"version": md.version(dist), "imported": imported}))


if __name__ == "__main__":
    main(*sys.argv[1:])

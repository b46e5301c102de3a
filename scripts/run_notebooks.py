"""Execute the notebooks in place, so the repository shows their outputs: `python scripts/run_notebooks.py [NAME.ipynb ...]`.

Each notebook (default: every notebooks/*.ipynb) starts from a clean copy (outputs cleared), runs top to
bottom in a fresh kernel of this interpreter with notebooks/ as its working directory, and is written back
with its outputs (figures as PNG) but without what changes on every run: execution timestamps, kernel
ids, stderr streams (progress bars, timings, warnings). Re-running on the same machine leaves the diff
empty or at most a few changed pixels/digits from floating-point noise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TIMEOUT_S = 600  # per cell
MAX_BYTES = 1_000_000  # a notebook committed with its outputs stays small


def clear(nb) -> None:
    """Outputs, execution counts and per-cell metadata that a run fills in."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)


def strip_volatile(nb) -> None:
    """What differs between two runs of the same code: timings, kernel/session ids, stderr streams."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr")]
            for o in cell.outputs:
                o.get("metadata", {}).pop("execution", None)
    for key in ("widgets", "papermill"):
        nb.metadata.pop(key, None)


def execute(path: Path, timeout: int = TIMEOUT_S):
    """The notebook at ``path`` run from a clean copy; returns the executed (unstripped) notebook."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    clear(nb)
    # the kernelspec runs `python`: make it this interpreter (the venv), whatever PATH we were started with
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("WANDB_MODE", "disabled")
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook files (default: every notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    import nbformat

    paths = [Path(n) if Path(n).exists() else NOTEBOOKS / n for n in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        if not path.is_file():
            print(f"run_notebooks: {path} is not a notebook file", file=sys.stderr)
            return 2
        nb = execute(path)
        strip_volatile(nb)
        text = nbformat.writes(nb) + "\n"
        path.write_text(text)
        images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        print(f"{path.name}: executed, {images} figure(s), {len(text.encode()) / 1e3:.0f} kB")
        if len(text.encode()) > MAX_BYTES:
            print(f"run_notebooks: {path.name} is over {MAX_BYTES / 1e6:.0f} MB with its outputs; draw smaller "
                  "figures (dpi, fewer panels)", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

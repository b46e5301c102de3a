"""Trace the walk of ``vitpipe.tasks.train.train(cfg)`` through vitpipe's own modules (a development tool).

Run from the repository root: ``python tests/tools/walk_train.py [overrides ...]``. It composes the debug
config the tests use, trains it once under ``sys.setprofile`` and records every call from one vitpipe
module into another (calls made by torch, Lightning or Hydra into vitpipe are not steps of the walk: they
are the framework driving the loop). It prints

* stays: the walk's steps with consecutive calls into the same module merged (``a -> b -> a`` is 3),
* modules: how many distinct modules the walk entered, and how often each,
* climbs: calls from a module into one of a higher layer (tests/test_layout.py LAYERS), which the import
  rule forbids as imports and which can only happen through a callable handed down.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_layout import layer_of  # noqa: E402


def _compose(overrides: list[str], out: Path):
    from conftest import make_cfg  # the tests' own composition: outputs under ``out``

    return make_cfg(out, overrides)


COMPREHENSIONS = {"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"}  # a loop, not a step


def walk(overrides: list[str]) -> dict:
    from vitpipe.tasks.train import train

    out = Path(tempfile.mkdtemp(prefix="vitpipe-walk-"))
    cfg = _compose(overrides, out)
    steps: list[str] = []
    climbs: list[str] = []
    fit_at: list[int] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name in COMPREHENSIONS:
            return
        callee = frame.f_globals.get("__name__", "")
        if not fit_at and callee == "lightning.pytorch.trainer.trainer" and frame.f_code.co_name == "fit":
            fit_at.append(len(steps))
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if not (callee.startswith("vitpipe.") and caller.startswith("vitpipe.")) or callee == caller:
            return
        if not steps or steps[-1] != callee:
            steps.append(callee)
        lc, le = layer_of(caller), layer_of(callee)
        if lc is not None and le is not None and le > lc:
            climbs.append(f"{caller} -> {callee}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
    setup = steps[: fit_at[0]] if fit_at else steps
    return {"setup_stays": len(setup), "setup_modules": len(set(setup)),
            "setup_entered": dict(Counter(setup).most_common()), "stays": len(steps), "modules": len(set(steps)),
            "entered": dict(Counter(steps).most_common()),
            "climbs": len(climbs), "climb_calls": sorted(Counter(climbs).items()), "walk": steps}


if __name__ == "__main__":
    default = ["debug=fast", "logger=none", "trainer.max_epochs=1", "++trainer.limit_train_batches=2",
               "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2"]
    result = walk(sys.argv[1:] or default)
    walk_steps = result.pop("walk")
    print(json.dumps(result, indent=1))
    print("setup:", " -> ".join(s.removeprefix("vitpipe.") for s in walk_steps[: result["setup_stays"]]))

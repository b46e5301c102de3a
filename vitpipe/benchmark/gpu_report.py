"""The GPU check's report: what its steps left in the work folder (each step's log, the tests' junit.xml
and figures, the benchmark JSON files, the recipe's run) turned into ``gpu_check.json`` (every figure
and each step's status), ``gpu_check.md`` (the same as tables) and ``gpu_check.log`` (the end of each
step's output). Rewritten after every step, each file by temp + rename, so a check stopped from
outside leaves what it had measured. A missing or unreadable file is left out, never fatal: the
report must describe a half-finished run too."""

from __future__ import annotations

import csv
import json
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from vitpipe.benchmark.table import rows
from vitpipe.run.files import atomic_write_text

SCHEMA = "vitpipe.gpu_check/1"


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(work: Path) -> list[dict]:
    """The gpu tests' outcomes: junit.xml, or the pytest log's -v lines when a timeout left no junit.xml."""
    tests = []
    junit = work / "junit.xml"
    if junit.exists():
        try:
            for case in ET.parse(junit).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                        break
                tests.append({"test": case.get("name"), "outcome": outcome,
                              "seconds": round(float(case.get("time", 0)), 1), "message": message})
        except ET.ParseError as e:
            tests.append({"test": "junit.xml", "outcome": "unreadable", "message": str(e)})
    elif (work / "logs" / "tests.log").exists():
        seen = re.findall(r"^tests/test_gpu\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR)",
                          (work / "logs" / "tests.log").read_text(errors="replace"), re.M)
        tests = [{"test": name, "outcome": outcome.lower(), "message": "from the pytest log (no junit.xml)"}
                 for name, outcome in seen]
    figures = {path.stem: _load(path) or {} for path in sorted((work / "figures").glob("*.json"))}
    for t in tests:
        t["figures"] = figures.get(re.sub(r"[^A-Za-z0-9_.-]+", "_", t["test"]))
    return tests


def bench_summary(path: Path) -> dict | None:
    """One benchmark JSON (scripts/benchmark.py --out) as the report's rows: the table's rows, rounded."""
    res = _load(path)
    if not res:
        return None
    cfg, env = res["config"], res["env"]
    table = []
    for comp, name, phase, s in rows(res):
        mem = (s.get("memory") or {}).get("peak_step_bytes")
        table.append({"comparison": comp, "contender": name, "phase": phase,
                      "step_ms": round(1e3 * s["step_s"], 2), "img_s": round(s["img_s"], 1),
                      "tflops": None if s.get("tflops") is None else round(s["tflops"], 3),
                      "mfu": None if s.get("mfu") is None else round(s["mfu"], 4),
                      "peak_step_mib": None if mem is None else round(mem / 2**20)})
    ratios = {f"{comp}: {k}": round(v, 4) for comp, r in res["results"].items() for k, v in r["ratios"].items()}
    extra = {comp: {k: r[k] for k in ("max_abs_logit_diff", "peak_tflops", "unavailable") if k in r}
             for comp, r in res["results"].items()}
    return {"device": env.get("device_name"), "variant": cfg["variant"], "img_size": cfg["img_size"],
            "batch_size": cfg["batch_size"], "precision": cfg["precision"], "compile": cfg["compile"],
            "float32_matmul_precision": env.get("float32_matmul_precision"), "torch": env.get("torch"),
            "steps": cfg["steps"], "warmup": cfg["warmup"], "repeats": cfg["repeats"], "rows": table,
            "ratios": ratios, "extra": extra}


def _recipe(work: Path, steps: list[dict]) -> dict | None:
    """The Fashion-MNIST recipe: its metrics, epochs done (history.csv: one row per epoch), TTA."""
    run = work / "fmnist"
    if not run.is_dir():
        return None
    metrics = _load(run / "metrics.json") or {}
    epochs = None
    try:
        with open(run / "history.csv", newline="") as f:
            epochs = sum(1 for _ in csv.DictReader(f))
    except OSError:
        pass
    tta = _load(work / "fmnist_tta" / "metrics.json") or {}
    return {"epochs_done": epochs, "budget_s": metrics.get("time/budget_s"), "run_s": metrics.get("time/run_s"),
            "test_acc": metrics.get("test/acc"), "val_acc_best": metrics.get("val/acc_best"),
            "test_loss": metrics.get("test/loss"), "test_acc_tta_hflip": tta.get("test/acc"),
            "train_seconds": next((s["seconds"] for s in steps if s["step"] == "recipe"), None)}


def collect(work: Path, *, dry: bool, budget: int, steps: list[dict]) -> dict:
    """The report's content; ``steps``: ``{"step", "status", "rc", "seconds", "note"}`` in run order."""
    return {"schema": SCHEMA, "mode": "cpu-dry-run" if dry else "gpu", "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "budget_s": budget, "env": _load(work / "env.json"), "steps": steps, "tests": _tests(work),
            "benchmarks": {p.stem: bench_summary(p) for p in sorted(work.glob("bench_*.json"))},
            "recipe": _recipe(work, steps)}


def markdown(result: dict) -> str:
    env, dry, recipe = result["env"] or {}, result["mode"] == "cpu-dry-run", result["recipe"]
    r4 = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
    md = [f"# vitpipe GPU check ({result['mode']})", "",
          f"Device: {env.get('device_name', '?')} (driver {env.get('driver', '?')}, capability "
          f"{env.get('capability', '?')}), torch {env.get('torch', '?')}, lightning {env.get('lightning', '?')}, "
          f"timm {env.get('timm', '?')}, Python {env.get('python', '?')}; written {result['written']}. "
          + ("CPU dry run: the figures below are CPU figures, not GPU ones." if dry else ""), "",
          "| step | status | seconds | note |", "|---|---|---|---|"]
    md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in result["steps"]]
    if result["tests"]:
        md += ["", "| test | outcome | seconds | figures / message |", "|---|---|---|---|"]
        for t in result["tests"]:
            fig = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in (t["figures"] or {}).items()
                   if k not in ("test", "device")}
            md.append(f"| {t['test']} | {t['outcome']} | {t.get('seconds', '')} | "
                      f"{t.get('message') or ''} {json.dumps(fig) if fig else ''} |")
    for name, b in result["benchmarks"].items():
        if not b:
            continue
        md += ["", f"**{name}**: {b['variant']} at {b['img_size']} px, batch {b['batch_size']}, {b['precision']}, "
                   f"fp32 matmul {b['float32_matmul_precision']}, compile={b['compile']}, {b['steps']} steps x "
                   f"{b['repeats']} repeats after {b['warmup']} warm-up, on {b['device']}", "",
               "| comparison | contender | phase | step ms | img/s | TFLOP/s | MFU | peak MiB |",
               "|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            md.append(f"| {r['comparison']} | {r['contender']} | {r['phase']} | {r['step_ms']} | {r['img_s']} | "
                      f"{r['tflops'] if r['tflops'] is not None else ''} | {mfu} | {r['peak_step_mib'] or ''} |")
        md += [""] + [f"- {k}: {v}" for k, v in b["ratios"].items()]
    if recipe:
        md += ["", "| recipe | epochs | test acc | + TTA (hflip) | val acc best | seconds |", "|---|---|---|---|---|---|",
               f"| experiment=fmnist_vit (trainer.time_budget={recipe['budget_s']} s, used {recipe['run_s']} s) | "
               f"{recipe['epochs_done']} | {r4(recipe['test_acc'])} | "
               f"{r4(recipe['test_acc_tta_hflip'])} | {r4(recipe['val_acc_best'])} | {recipe['train_seconds']} |"]
    return "\n".join(md) + "\n"


def log_tails(work: Path, steps: list[dict], lines: int = 150) -> str:
    """The end of each step's output, in step order."""
    parts = []
    for s in steps:
        path = work / "logs" / f"{s['step']}.log"
        if path.exists():
            text = path.read_text(errors="replace").splitlines()
            parts += [f"===== {s['step']}: {s['status']} (rc {s['rc']}, {s['seconds']} s), last {min(len(text), lines)} "
                      f"of {len(text)} lines", *text[-lines:], ""]
    return "\n".join(parts) + "\n"


def write_report(work: Path, out: Path, *, dry: bool, budget: int, steps: list[dict]) -> None:
    result = collect(work, dry=dry, budget=budget, steps=steps)
    atomic_write_text(out / "gpu_check.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "gpu_check.md", markdown(result))
    atomic_write_text(out / "gpu_check.log", log_tails(work, steps))

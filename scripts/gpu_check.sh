#!/usr/bin/env bash
# The GPU check, unattended, in at most 8 minutes on one GPU: the gpu-marked tests, the ViT-B/16
# benchmark (throughput and MFU in bf16-mixed, then TF32), the Fashion-MNIST recipe with its test
# accuracy (and mirror TTA), then plain fp32 and the speed switches if time is left.
#
#   bash scripts/gpu_check.sh [--cpu-dry-run] [--print-steps] [OUT_DIR]
#
# OUT_DIR (default: $OUT, else ./gpu_check_out) receives gpu_check.json (every figure and each step's
# status, rc, seconds), gpu_check.md (the same as tables) and gpu_check.log (the end of each step's
# output). Each step runs under `timeout` within what is left of GPU_CHECK_BUDGET_S (default 480 s);
# a failed or timed-out step is recorded and the next one runs. The three files are rewritten after
# every step, so a run stopped from outside leaves what it had measured. Run files (checkpoints, data)
# go to GPU_CHECK_WORK (default: a new folder under /tmp), not OUT_DIR.
#
# On the GPU machine (torch, lightning, timm, pytest there; hydra-core and omegaconf not): when
# `import hydra, omegaconf` fails, the wheels in .whl/ are installed into /tmp/site. Fashion-MNIST is
# read from Debian's /usr/share/datasets/fashion-mnist or from .gpu_data/fashion-mnist; without
# either, the recipe step is skipped with a line saying so. scripts/gpu_wheels.sh fills both folders
# on a machine with a package index; carry them with the working tree.
#
# GPU_CHECK_ONLY=tests,recipe (names as in gpu_check.json) runs only those steps, e.g. to redo one.
# --print-steps prints each step's name and command (tab-separated, shell-quoted) and runs nothing
# (tests/test_gpu_check.py checks them against the test file, benchmark.py's flags and the configs).
#
# --cpu-dry-run (or GPU_CHECK_DRY_RUN=1): the same steps, tiny, on the CPU (--device cpu, trainer=cpu,
# vit_micro, a few batches), to prove the script on a machine without a GPU. Its figures are CPU
# figures. The gpu tests skip there, unless GPU_CHECK_TESTS_ON_CPU=1 (VITPIPE_GPU_TEST_DEVICE=cpu:
# the tests' own logic on the CPU, several minutes on 2 cores).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=${GPU_CHECK_DRY_RUN:-0}
PRINT=0
OUT_DIR=""
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) DRY=1 ;;
    --print-steps) PRINT=1 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    -*) echo "gpu_check: error: unknown option $arg (valid: --cpu-dry-run, an output directory)" >&2; exit 2 ;;
    *) OUT_DIR=$arg ;;
  esac
done
OUT_DIR=${OUT_DIR:-${OUT:-./gpu_check_out}}
if [ "$PRINT" = 1 ]; then
  WORK=${GPU_CHECK_WORK:-/tmp/gpu_check.print}  # named in the commands, never made
else
  mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
  WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
  mkdir -p "$WORK/logs" "$WORK/figures"
  : >"$WORK/steps.tsv"
fi
TESTS_ON_CPU=0
[ "$DRY" = 1 ] && [ "${GPU_CHECK_TESTS_ON_CPU:-0}" = 1 ] && TESTS_ON_CPU=1
if [ "$TESTS_ON_CPU" = 1 ]; then  # the tests' logic on a CPU: minutes per test
  BUDGET=${GPU_CHECK_BUDGET_S:-1000} TESTS_MAX=700 TEST_TIMEOUT=400
else
  BUDGET=${GPU_CHECK_BUDGET_S:-480} TESTS_MAX=200 TEST_TIMEOUT=170
fi
START=$(date +%s)
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export GPU_CHECK_DRY="$DRY" GPU_CHECK_OUT="$OUT_DIR" GPU_CHECK_WORK_DIR="$WORK" GPU_CHECK_BUDGET="$BUDGET"

if [ "$DRY" = 1 ]; then
  DEVICE=cpu TRAINER=cpu VARIANT=vit_micro
  BENCH_SIZE=(--batch-size 4 --steps 2 --warmup 1 --repeats 1 --workers 0)
  RECIPE_SHORT=(trainer.max_epochs=1 ++trainer.limit_train_batches=3 ++trainer.limit_val_batches=2
                ++trainer.limit_test_batches=2)
  EVAL_SHORT=(++trainer.limit_test_batches=2)
else
  DEVICE=cuda TRAINER=gpu VARIANT=vit_b16
  BENCH_SIZE=(--batch-size 256 --steps 20 --warmup 5 --repeats 3)
  RECIPE_SHORT=()
  EVAL_SHORT=()
fi

remaining() { echo $((BUDGET - ($(date +%s) - START))); }
wanted() { [ -z "${GPU_CHECK_ONLY:-}" ] || [[ ",$GPU_CHECK_ONLY," == *",$1,"* ]]; }

# record NAME STATUS RC SECONDS NOTE  (one line of steps.tsv; the collector turns it into JSON)
record() { [ "$PRINT" = 1 ] || printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >>"$WORK/steps.tsv"; }

# step NAME MAX_SECONDS RESERVE_SECONDS CMD...: run CMD under timeout, at most MAX_SECONDS and never into
# the last RESERVE_SECONDS of the budget (kept for later steps); its output goes to logs/NAME.log
step() {
  local name=$1 max=$2 reserve=$3
  shift 3
  wanted "$name" || return 0
  if [ "$PRINT" = 1 ]; then
    printf '%s\t' "$name"; printf '%q ' "$@"; echo
    return 0
  fi
  local left=$(($(remaining) - reserve))
  local limit=$((max < left ? max : left))
  if [ "$limit" -lt 15 ]; then
    record "$name" skipped "" 0 "budget spent: $(remaining) s of ${BUDGET} s left"
    echo "== $name: skipped (budget spent)"
    collect
    return 0
  fi
  echo "== $name (at most ${limit} s): $*"
  local t0=$(date +%s) rc status note=""
  timeout -k 10 "$limit" "$@" >"$WORK/logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout; note="stopped by timeout after ${limit} s" ;;
    *) status=failed; note="$(grep -E 'error|Error|FAILED' "$WORK/logs/$name.log" | tail -n 1 | cut -c1-300)" ;;
  esac
  record "$name" "$status" "$rc" $(($(date +%s) - t0)) "$note"
  echo "   $status (rc $rc, $(($(date +%s) - t0)) s)"
  collect
}

collect() {
  [ "$PRINT" = 1 ] && return 0
  "$PY" - <<'PYEOF' || echo "gpu_check: the collector failed; raw files are in $GPU_CHECK_WORK_DIR" >&2
# Turns the steps' files into gpu_check.json / .md / .log. Standard library only: it must also run
# when hydra or vitpipe cannot be imported. Files are written to a temp file and renamed.
import csv, glob, json, os, re, time
import xml.etree.ElementTree as ET

work, out = os.environ["GPU_CHECK_WORK_DIR"], os.environ["GPU_CHECK_OUT"]
dry = os.environ["GPU_CHECK_DRY"] == "1"


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


steps = []
with open(os.path.join(work, "steps.tsv")) as f:
    for line in f:
        name, status, rc, seconds, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
        steps.append({"step": name, "status": status, "rc": int(rc) if rc else None, "seconds": int(seconds),
                      "note": note})

result = {"schema": "vitpipe.gpu_check/1", "mode": "cpu-dry-run" if dry else "gpu",
          "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_s": int(os.environ["GPU_CHECK_BUDGET"]),
          "env": load(os.path.join(work, "env.json")), "steps": steps}

# the gpu tests: junit outcome per test + the figures each test wrote
tests = []
junit = os.path.join(work, "junit.xml")
if os.path.exists(junit):
    try:
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                    break
            tests.append({"test": case.get("name"), "outcome": outcome, "seconds": round(float(case.get("time", 0)), 1),
                          "message": message})
    except ET.ParseError as e:
        tests.append({"test": "junit.xml", "outcome": "unreadable", "message": str(e)})
elif os.path.exists(os.path.join(work, "logs", "tests.log")):  # pytest stopped before writing junit.xml
    seen = re.findall(r"^tests/test_gpu\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR)",
                      open(os.path.join(work, "logs", "tests.log"), errors="replace").read(), re.M)
    tests = [{"test": name, "outcome": outcome.lower(), "message": "from the pytest log (no junit.xml)"}
             for name, outcome in seen]
figures = {}
for path in sorted(glob.glob(os.path.join(work, "figures", "*.json"))):
    record = load(path) or {}
    figures[os.path.basename(path)[:-5]] = record
for t in tests:
    t["figures"] = figures.get(re.sub(r"[^A-Za-z0-9_.-]+", "_", t["test"]))
result["tests"] = tests


def bench_summary(path):
    res = load(path)
    if not res:
        return None
    cfg, env = res["config"], res["env"]
    rows = []
    for comp, r in res["results"].items():
        for name, phases in r["contenders"].items():
            for phase, s in phases.items():
                mem = (s.get("memory") or {}).get("peak_step_bytes")
                rows.append({"comparison": comp, "contender": name, "phase": phase,
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
            "steps": cfg["steps"], "warmup": cfg["warmup"], "repeats": cfg["repeats"], "rows": rows,
            "ratios": ratios, "extra": extra}


result["benchmarks"] = {os.path.basename(p)[:-5]: bench_summary(p)
                        for p in sorted(glob.glob(os.path.join(work, "bench_*.json")))}

# the Fashion-MNIST recipe: its metrics, epochs done (history.csv: one row per epoch), TTA
run = os.path.join(work, "fmnist")
recipe = None
if os.path.isdir(run):
    metrics = load(os.path.join(run, "metrics.json")) or {}
    epochs = None
    try:
        with open(os.path.join(run, "history.csv"), newline="") as f:
            epochs = sum(1 for _ in csv.DictReader(f))
    except OSError:
        pass
    tta = load(os.path.join(work, "fmnist_tta", "metrics.json")) or {}
    log = os.path.join(work, "logs", "recipe.log")
    text = open(log, errors="replace").read() if os.path.exists(log) else ""
    recipe = {"epochs_done": epochs, "max_epochs": 11, "stopped_by_max_time": "Time limit reached" in text,
              "test_acc": metrics.get("test/acc"), "val_acc_best": metrics.get("val/acc_best"),
              "test_loss": metrics.get("test/loss"), "test_acc_tta_hflip": tta.get("test/acc"),
              "train_seconds": next((s["seconds"] for s in steps if s["step"] == "recipe"), None)}
result["recipe"] = recipe
write(os.path.join(out, "gpu_check.json"), json.dumps(result, indent=2) + "\n")

# the same as markdown
env = result["env"] or {}
r4 = lambda v: "" if v is None else f"{v:.4f}"  # noqa: E731
md = [f"# vitpipe GPU check ({result['mode']})", "",
      f"Device: {env.get('device_name', '?')} (driver {env.get('driver', '?')}, capability "
      f"{env.get('capability', '?')}), torch {env.get('torch', '?')}, lightning {env.get('lightning', '?')}, "
      f"timm {env.get('timm', '?')}, Python {env.get('python', '?')}; written {result['written']}. "
      + ("CPU dry run: the figures below are CPU figures, not GPU ones." if dry else ""), "",
      "| step | status | seconds | note |", "|---|---|---|---|"]
md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['note']} |" for s in steps]
if tests:
    md += ["", "| test | outcome | seconds | figures / message |", "|---|---|---|---|"]
    for t in tests:
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
           f"| experiment=fmnist_vit{' (stopped by max_time)' if recipe['stopped_by_max_time'] else ''} | "
           f"{recipe['epochs_done']} of {recipe['max_epochs']} | {r4(recipe['test_acc'])} | "
           f"{r4(recipe['test_acc_tta_hflip'])} | {r4(recipe['val_acc_best'])} | {recipe['train_seconds']} |"]
write(os.path.join(out, "gpu_check.md"), "\n".join(md) + "\n")

# the end of each step's output, in step order
parts = []
for s in steps:
    path = os.path.join(work, "logs", f"{s['step']}.log")
    if os.path.exists(path):
        lines = open(path, errors="replace").read().splitlines()
        parts += [f"===== {s['step']}: {s['status']} (rc {s['rc']}, {s['seconds']} s), last {min(len(lines), 150)} "
                  f"of {len(lines)} lines", *lines[-150:], ""]
write(os.path.join(out, "gpu_check.log"), "\n".join(parts) + "\n")
PYEOF
}

[ "$PRINT" = 1 ] || echo "gpu_check: mode $([ "$DRY" = 1 ] && echo cpu-dry-run || echo gpu), budget ${BUDGET} s, out $OUT_DIR, work $WORK"

# 1. Python packages: hydra and omegaconf from the carried wheels when missing
t0=$(date +%s)
if [ "$PRINT" = 1 ]; then
  :
elif "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  record wheels ok 0 0 "hydra and omegaconf already importable"
elif ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
       >"$WORK/logs/wheels.log" 2>&1 && export PYTHONPATH="/tmp/site:$PYTHONPATH" \
       && "$PY" -c "import hydra, omegaconf" >>"$WORK/logs/wheels.log" 2>&1; then
    record wheels ok 0 $(($(date +%s) - t0)) "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  else
    record wheels failed 1 $(($(date +%s) - t0)) "installing .whl/*.whl failed: $(tail -n 1 "$WORK/logs/wheels.log")"
  fi
else
  record wheels failed 1 0 "hydra/omegaconf missing and no .whl/*.whl: run scripts/gpu_wheels.sh and carry .whl"
fi

# 2. the machine
step env 60 0 "$PY" - <<'PYEOF'
import json, os, platform, subprocess
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
for name in ("lightning", "timm", "torchmetrics", "torchvision", "hydra", "omegaconf"):
    try:
        info[name] = __import__(name).__version__
    except Exception as e:  # recorded, not fatal: the steps that need it fail on their own
        info[name] = f"missing ({type(e).__name__})"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info |= {"device_name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
             "multiprocessors": p.multi_processor_count, "bf16_supported": torch.cuda.is_bf16_supported()}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["driver"] = "unknown"
else:
    with open("/proc/cpuinfo") as f:
        info["device_name"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "cpu")
    info["driver"] = "-"
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or "unknown"
except (OSError, subprocess.SubprocessError):
    info["commit"] = "unknown"
path = os.path.join(os.environ["GPU_CHECK_WORK_DIR"], "env.json")
with open(path + ".tmp", "w") as f:
    json.dump(info, f, indent=2)
os.replace(path + ".tmp", path)
print(json.dumps(info, indent=2))
if os.environ["GPU_CHECK_DRY"] != "1" and not torch.cuda.is_available():
    raise SystemExit("gpu_check: error: torch sees no CUDA device; use --cpu-dry-run on a machine without one")
PYEOF

# 3. the gpu-marked tests (each writes its figures to $VITPIPE_GPU_FIGURES)
# -v: one line per test as it ends, which the collector reads when a timeout leaves no junit.xml
PYTEST_ARGS=(-v -m gpu tests/test_gpu.py -p no:cacheprovider -rfEs --junitxml="$WORK/junit.xml")
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout="$TEST_TIMEOUT")
TEST_ENV=(env VITPIPE_GPU_FIGURES="$WORK/figures")
[ "$TESTS_ON_CPU" = 1 ] && TEST_ENV+=(VITPIPE_GPU_TEST_DEVICE=cpu OMP_NUM_THREADS=1)
step tests "$TESTS_MAX" 180 "${TEST_ENV[@]}" "$PY" -m pytest "${PYTEST_ARGS[@]}"

# 4. throughput and MFU: ViT-B/16 (dry run: vit_micro), vitpipe vs timm and Lightning vs a plain loop
step bench_bf16 90 100 "$PY" scripts/benchmark.py --device "$DEVICE" --precision bf16-mixed --variant "$VARIANT" \
  "${BENCH_SIZE[@]}" --only vit,lightning --out "$WORK/bench_bf16.json"
# fp32 matmuls on TF32 tensor cores (--tf32: float32_matmul_precision high), vitpipe vs timm only
if [ "$DEVICE" = cuda ]; then
  step bench_tf32 45 120 "$PY" scripts/benchmark.py --device cuda --precision 32-true --tf32 --variant "$VARIANT" \
    --batch-size 256 --steps 10 --warmup 3 --repeats 2 --only vit --out "$WORK/bench_tf32.json"
fi

# 5. the Fashion-MNIST recipe (11 epochs), stopped by max_time if the budget runs short, then mirror TTA
FMNIST_FILES="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
has_fmnist() { for f in $FMNIST_FILES; do [ -f "$1/$f" ] || return 1; done; }
RECIPE_DATA=()
if [ "$PRINT" = 0 ] && has_fmnist /usr/share/datasets/fashion-mnist; then
  :
elif [ "$PRINT" = 1 ] || has_fmnist "$ROOT/.gpu_data/fashion-mnist"; then  # printing: the carried case
  RECIPE_DATA=("+data.system_dir=$ROOT/.gpu_data/fashion-mnist")
fi
if ! wanted recipe; then
  :
elif has_fmnist /usr/share/datasets/fashion-mnist || [ ${#RECIPE_DATA[@]} -gt 0 ]; then
  left=$(($(remaining) - 40))  # the TTA evaluation after it
  # Lightning's max_time ends training cleanly (then the best checkpoint is tested); the timeout is the backstop
  max_time=$((left - 40))  # start-up (data, teacher) and the test phase after training
  if [ "$max_time" -ge 30 ]; then
    step recipe "$left" 40 "$PY" scripts/train.py experiment=fmnist_vit trainer="$TRAINER" data.download=false \
      "${RECIPE_DATA[@]}" "${RECIPE_SHORT[@]}" "++trainer.max_time=$(printf '00:00:%02d:%02d' $((max_time / 60)) $((max_time % 60)))" \
      paths.data_dir="$WORK/data" paths.log_dir="$WORK/logs_runs" hydra.run.dir="$WORK/fmnist"
    if [ "$PRINT" = 1 ] || [ -f "$WORK/fmnist/metrics.json" ]; then
      step recipe_tta 40 0 "$PY" scripts/eval.py ckpt_path="$WORK/fmnist" tta=hflip trainer="$TRAINER" \
        "${EVAL_SHORT[@]}" paths.data_dir="$WORK/data" paths.log_dir="$WORK/logs_runs" hydra.run.dir="$WORK/fmnist_tta"
    else
      record recipe_tta skipped "" 0 "the recipe wrote no metrics.json"
    fi
  else
    record recipe skipped "" 0 "budget spent: $(remaining) s left"
  fi
else
  record recipe skipped "" 0 "no Fashion-MNIST: neither /usr/share/datasets/fashion-mnist nor .gpu_data/fashion-mnist (run scripts/gpu_wheels.sh, carry .gpu_data)"
fi
collect

# 6. if time is left: plain fp32 (no TF32), then the speed switches (fused AdamW, compile, SDPA backends)
if [ "$DEVICE" = cuda ]; then
  step bench_fp32 60 0 "$PY" scripts/benchmark.py --device cuda --precision 32-true --variant "$VARIANT" \
    --batch-size 256 --steps 10 --warmup 3 --repeats 2 --only vit --out "$WORK/bench_fp32.json"
  step bench_switches 120 0 "$PY" scripts/benchmark.py --device cuda --precision bf16-mixed --variant "$VARIANT" \
    --batch-size 256 --steps 10 --warmup 3 --repeats 2 --only switches --out "$WORK/bench_switches.json"
else
  step bench_switches 60 0 "$PY" scripts/benchmark.py --device cpu --precision 32-true --variant "$VARIANT" \
    "${BENCH_SIZE[@]}" --only switches --switches adamw_fused,sdpa_math --out "$WORK/bench_switches.json"
fi

[ "$PRINT" = 1 ] && exit 0
collect
bad=$(cut -f2 "$WORK/steps.tsv" | grep -c -E '^(failed|timeout)$')
echo "gpu_check: done in $(($(date +%s) - START)) s, $bad step(s) failed; $OUT_DIR/gpu_check.{json,md,log}"
[ "$bad" = 0 ]

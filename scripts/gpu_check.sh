#!/usr/bin/env bash
# The GPU check (body: vitpipe/benchmark/gpu_check.py; --help prints its usage):
#
#   bash scripts/gpu_check.sh [--cpu-dry-run] [--print-steps] [OUT_DIR]
#
# This wrapper does the one thing the Python module cannot do for itself: importing vitpipe needs
# hydra-core and omegaconf, which the GPU machine lacks, so when `import hydra, omegaconf` fails the
# wheels carried in .whl/ (scripts/gpu_wheels.sh) are installed into /tmp/site first; the outcome
# goes to the module (GPU_CHECK_WHEELS) and into gpu_check.json as the step `wheels`.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

case " $* " in *" --print-steps "*|*" -h "*|*" --help "*) exec "$PY" -m vitpipe.benchmark.gpu_check "$@" ;; esac
t0=$(date +%s)
if "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
  export GPU_CHECK_WHEELS=$'ok\t0\thydra and omegaconf already importable'
elif ls .whl/*.whl >/dev/null 2>&1; then
  export GPU_CHECK_WHEELS_LOG=$(mktemp /tmp/gpu_check_wheels.XXXXXX)
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
       >"$GPU_CHECK_WHEELS_LOG" 2>&1 && export PYTHONPATH="/tmp/site:$PYTHONPATH" \
       && "$PY" -c "import hydra, omegaconf" >>"$GPU_CHECK_WHEELS_LOG" 2>&1; then
    export GPU_CHECK_WHEELS="ok"$'\t'"$(($(date +%s) - t0))"$'\t'"installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  else
    echo "gpu_check: error: installing .whl/*.whl failed: $(tail -n 1 "$GPU_CHECK_WHEELS_LOG")" >&2
    exit 2
  fi
else
  echo "gpu_check: error: hydra/omegaconf missing and no .whl/*.whl: run scripts/gpu_wheels.sh and carry .whl" >&2
  exit 2
fi
exec "$PY" -m vitpipe.benchmark.gpu_check "$@"

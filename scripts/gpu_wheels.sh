#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine that has no package index, fetched here:
#   .whl/       the wheels of the packages that machine lacks (installed there into /tmp/site)
#   .gpu_data/  Fashion-MNIST's four gz idx files (30 MB), copied from Debian's dataset-fashion-mnist
# Both folders are git-ignored; carry them with the working tree.
#
#   bash scripts/gpu_wheels.sh [--no-data]
#
# Which wheels: pyproject's dependencies minus what the GPU machine's image already holds (torch,
# torchvision, lightning, timm, torchmetrics, matplotlib, scikit-learn, safetensors, tensorboard,
# rich, pillow, numpy, tqdm, pyyaml, packaging, cloudpickle, typing-extensions, pytest,
# pytest-timeout): hydra-core and omegaconf, the antlr4 runtime 4.9 that both pin, and the two
# packages hydra_plugins/vitpipe_slurm imports when Hydra scans its plugins (hydra-submitit-launcher,
# submitit; without them every command prints an import warning). Not carried: wandb (imported only
# with logger=wandb) and litdata (only with data=shards), which no step of the check uses.
# Versions: those installed here when they are, else the pins below. About 0.5 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DATA=1
for arg in "$@"; do
  case "$arg" in
    --no-data) DATA=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu_wheels: error: unknown argument $arg (valid: --no-data)" >&2; exit 2 ;;
  esac
done

# name and fallback version; the version installed here wins, so the carried code runs what was tested
PACKAGES="hydra-core:1.3.2 omegaconf:2.3.0 antlr4-python3-runtime:4.9.3 hydra-submitit-launcher:1.2.0 submitit:1.5.4"
version_of() {
  "$PY" - "$1" "$2" <<'EOF'
import importlib.metadata as m, sys
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    print(sys.argv[2])
EOF
}

# the platform tags of the GPU machine's Python 3.12 (x86-64, manylinux)
PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux1_x86_64)
tmp=$(mktemp -d .whl.tmp-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
for spec in $PACKAGES; do
  name=${spec%%:*}
  pin="$name==$(version_of "$name" "${spec#*:}")"
  if [ "$name" = antlr4-python3-runtime ]; then
    # PyPI has only a source archive of 4.9.x (hydra-core and omegaconf pin 4.9.*): build its pure-Python
    # wheel (py3-none-any) here
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$tmp" "$pin"
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$tmp" "$pin"
  fi
done
# one version of each package (two stop the install there): the new set replaces the old one whole
rm -rf .whl
mv "$tmp" .whl
trap - EXIT
ls -l .whl
du -sh .whl

if [ "$DATA" = 1 ]; then
  src=/usr/share/datasets/fashion-mnist
  files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"
  if [ -d "$src" ]; then
    mkdir -p .gpu_data/fashion-mnist
    for f in $files; do
      cp "$src/$f" ".gpu_data/fashion-mnist/.$f.tmp" && mv ".gpu_data/fashion-mnist/.$f.tmp" ".gpu_data/fashion-mnist/$f"
    done
    du -sh .gpu_data
  else
    echo "gpu_wheels: $src is missing (apt-get install dataset-fashion-mnist): the check will skip the recipe step"
  fi
fi
echo "carry: .whl .gpu_data   (e.g. run: bash scripts/gpu_check.sh, with carry [\".whl\", \".gpu_data\"])"

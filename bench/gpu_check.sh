#!/usr/bin/env bash
# What parking costs on a real GPU, and whether the ledger agrees with NVML
# (bench/gpu_check.py says what it measures). Run from the checkout's root:
#
#   bench/gpu_check.sh [--switches N]
#
# On a machine without an NVIDIA GPU and PyTorch it says so and exits 0. It runs CapyCTL
# from this working tree with the machine's own Python (the one that has PyTorch);
# CapyCTL's other needs come from the machine, or else from wheels carried in .whl/
# (make gpu-wheels, on a machine with a network), installed into a folder of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU to check here (nvidia-smi is not installed); nothing was measured"
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no NVIDIA GPU to check here (PyTorch with CUDA is not in $PY); nothing was measured"
  exit 0
fi
if ! "$PY" -c "import django, rest_framework, channels, celery, dj_database_url" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: CapyCTL's dependencies are not installed here and no .whl/ folder was carried (make gpu-wheels)" >&2
    exit 2
  fi
  site=$(mktemp -d /tmp/capyctl-site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"

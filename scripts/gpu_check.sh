#!/usr/bin/env bash
# The GPU check, one command for the lent machine (jax 0.11+ with the CUDA 13 plugin, Python 3.12; nothing can be
# fetched there). Wheels the image lacks travel in .whl/ (fill it here with scripts/gpu_wheels.sh; carry ".whl")
# and are installed into a scratch folder on PYTHONPATH. Then scripts/gpu_check.py runs the phases (kernel tests,
# kernel benchmark, serving benchmarks) under one deadline, writing one JSON file per phase into OUT_DIR.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (PYTHON=... picks the interpreter; OUT_DIR defaults to $OUT or /tmp/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR"
SITE=/tmp/jaxseek_site
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# identical step programs of the benchmarks' engines compile once
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxseek_xla} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
exec "$PY" scripts/gpu_check.py "$OUT_DIR" --deadline "${GPU_CHECK_DEADLINE:-470}"

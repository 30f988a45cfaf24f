#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU machine's image lacks, at the versions this venv runs, for
# scripts/gpu_check.sh to install there (the device tool carries ".whl"; the image has jax, jaxtyping, optax,
# orbax, tokenizers, safetensors and pytest, but not llguidance, and an older flax may be there).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
pins=$("$PY" -m pip list --format=freeze | grep -iE '^(flax|llguidance)==')
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl $pins
ls -l .whl

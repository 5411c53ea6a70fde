#!/usr/bin/env bash
# Everything measured on one lent H200 in a single call (device time is scarce), written to $OUT:
#   env.txt, log.txt, kernel_bandwidth.json, reshard_llama3_8b.{json,png}, reshard_qwen2_7b.json,
#   train_llama1b.json, parity_bf16.json
# The machine has torch (CUDA), transformers, safetensors, matplotlib; megatron-core travels as a
# wheel in .whl/ (pip download --python-version 3.12 megatron-core==0.16.1).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
source benchmarks/h200_common.sh
h200_session
h200_setup
python3 -c "import megarl._C as C; print('[h200] with_cuda', C.with_cuda())"

echo "== GPU kernel tests"
timeout 120 python3 -m pytest -q -m gpu tests/test_segment_copy.py
echo "== kernel bandwidth"
timeout 120 python3 benchmarks/kernel_bandwidth.py --json "$OUT/kernel_bandwidth.json"
echo "== reshard llama3-8b TP1 -> R1"
timeout 240 torchrun --standalone --nproc-per-node 1 benchmarks/reshard_latency.py --model llama3-8b \
  --iters 30 --json "$OUT/reshard_llama3_8b.json" --plot "$OUT/reshard_llama3_8b.png"
echo "== reshard qwen2-7b TP1 -> R1"
timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/reshard_latency.py --model qwen2-7b \
  --iters 30 --json "$OUT/reshard_qwen2_7b.json"
bf16_parity
echo "== training step, llama-1b shape"
timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/train_throughput.py --model llama-1b --seq 2048 \
  --micro-batch 4 --steps 8 --json "$OUT/train_llama1b.json"
echo "[h200] done in $SECONDS s"

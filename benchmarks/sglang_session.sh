#!/usr/bin/env bash
# SGLang on one H200 with SGLang installed (PYTHONPATH may point at a staged copy): the adapter checks
# and hand-over timings (benchmarks/sglang_refit.py), then the RL loop end to end on SGLang (the tiny
# GRPO recipe in bf16, in-engine hand-over every step). megatron-core and rich travel as wheels in .whl/.
# Writes to $OUT: env.txt, log.txt, sglang_refit.json, train_tiny_sglang/metrics.jsonl (parity_bf16.json with PARITY=1).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
STEPS=${STEPS:-40}
source benchmarks/h200_common.sh
h200_session
h200_setup
python3 -c "import sglang; print('[h200] sglang', sglang.__version__)"

if [ -z "${SKIP_REFIT:-}" ]; then
  echo "== SGLang adapter and hand-over timings"
  timeout 330 python3 benchmarks/sglang_refit.py --work /tmp/megarl-sgl --iters 20 --json "$OUT/sglang_refit.json"
fi

echo "== RL loop on SGLang: tiny GRPO recipe, $STEPS steps"
timeout 300 torchrun --standalone --nproc-per-node 1 megarl/train.py --config recipes/tiny_cpu_grpo.yaml \
  "${SGLANG_ARGS[@]}" --set model.dtype=bfloat16 --set rollout.logprob_diff_max=1.0 \
  --set trainer.num_steps="$STEPS" --set checkpoint.dir=/tmp/train_tiny_sglang --set tracking.backend=none &
train=$!
# A stalled run shows where it waits (py-spy travels in .whl/ when wanted).
( sleep "${STALL_S:-200}"; if kill -0 $train 2>/dev/null && command -v py-spy >/dev/null; then
    for p in $(pgrep -f "megarl|sglang"); do echo "--- py-spy $p"; py-spy dump --pid "$p" 2>&1 | head -40; done; fi ) &
wait $train
echo "[h200] train exit code $?"
mkdir -p "$OUT/train_tiny_sglang" && cp /tmp/train_tiny_sglang/metrics.jsonl "$OUT/train_tiny_sglang/" 2>/dev/null
[ -n "${PARITY:-}" ] && bf16_parity
echo "[h200] done in $SECONDS s"

#!/usr/bin/env bash
# Reliability on one H200 with SGLang staged in /tmp/site (../shared/tools/sglang-h200) and megatron-core carried
# in .whl/ (issue: correctness and reliability, round two). Runs, each into $OUT:
#   setup:     record the machine, install .whl/, build the extension
#   truncated: which distribution SGLang's logprobs belong to under top-p/top-k (benchmarks/truncated_logprobs.py)
#   exit:      GRPO on the tiny recipe with SGLang, $STEPS steps: a finished run prints no traceback or CUDA IPC
#              warning (counted in $OUT/exit.log)
# PART selects a subset (default: setup truncated exit).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
PART=${PART:-setup truncated exit}
STEPS=${STEPS:-3}
source benchmarks/h200_common.sh
h200_session
TINY=(--set model.dtype=bfloat16 --set rollout.logprob_diff_max=2.0 --set rollout.gpu_memory_fraction=0.3 --set tracking.backend=none "${SGLANG_ARGS[@]}")

for part in $PART; do
  case $part in
    setup)
      h200_setup
      python3 -c "import sglang; print('[h200] sglang', sglang.__version__)" ;;
    truncated)
      timeout 400 python3 benchmarks/truncated_logprobs.py --out /tmp/trunc --json "$OUT/truncated_logprobs.json" \
        > "$OUT/truncated.log" 2>&1
      echo "[h200] truncated exit $?"; grep -v "^\[" "$OUT/truncated.log" | grep "top_p=\|did not start" | cut -c1-400 ;;
    exit)
      # DIAG=1: a sitecustomize carried in .diag/ prints who registers loky semaphores with the resource tracker.
      [[ -n ${DIAG:-} ]] && export PYTHONPATH=$PWD/.diag:$PYTHONPATH
      timeout 300 torchrun --standalone --nproc-per-node 1 megarl/train.py --config recipes/tiny_cpu_grpo.yaml \
        "${TINY[@]}" --set trainer.num_steps="$STEPS" --set checkpoint.dir=/tmp/exit > "$OUT/exit.log" 2>&1
      echo "[h200] exit run: exit code $?; tracebacks $(grep -c Traceback "$OUT/exit.log"), CUDA IPC warnings" \
           "$(grep -c 'Producer process has been terminated' "$OUT/exit.log")"
      tail -25 "$OUT/exit.log" | cut -c1-300
      [[ -n ${DIAG:-} ]] && grep -A30 "^LOKY" "$OUT/exit.log" | grep -v "^  File.*<frozen" | head -80 ;;
  esac
done

#!/usr/bin/env bash
# Qwen3-MoE on one H200 with SGLang staged in /tmp/site (../shared/tools/sglang-h200) and megatron-core + rich
# carried in .whl/, written to $OUT. Parts (PART selects; default all, in this order):
#   setup:        install, build the extension, write a random Qwen3-30B-A3B body of $LAYERS layers (tiny recipe's
#                 tokenizer) to $MODEL
#   grpo:         GRPO on it with one SGLang engine, $STEPS steps, the trainer routing by itself
#   grpo_replay:  the same with algorithm.routing_replay: the trainer replays the engine's expert choices
#                 (compare logprob_diff_mean and routing/disagreement between the two)
#   refit:        the full 30.5B shape (48 layers) handed over TP1 -> R1 on the GPU (benchmarks/reshard_latency.py)
#   sglang:       in-engine hand-over into an SGLang engine of the 30B-A3B shape against SGLang's stock update
#                 ($SGLANG_LAYERS layers: trainer tensors, engine-layout tensors and the engine's own copy
#                 must fit one GPU together)
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
PART=${PART:-setup grpo grpo_replay refit sglang}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-8}
SGLANG_LAYERS=${SGLANG_LAYERS:-24}
NPROC=1
MODEL=${MODEL:-/tmp/moe30b}
source benchmarks/h200_common.sh
h200_session
BIG=(--set model.hf_path=$MODEL --set model.dtype=bfloat16 --set rollout.gpu_memory_fraction=0.5
     --set rollout.max_new_tokens=32 --set rollout.logprob_diff_max=2.0 --set tracking.backend=none)

for part in $PART; do
  case $part in
    setup)
      h200_setup
      python3 -c "import sglang; print('[h200] sglang', sglang.__version__)"
      python3 benchmarks/make_random_model.py --preset qwen3-30b-a3b --tokenizer recipes/tiny/model --out $MODEL \
        --layers "$LAYERS" ;;
    grpo)
      h200_train moe_grpo recipes/tiny_cpu_grpo.yaml "$STEPS" ;;
    grpo_replay)
      h200_train moe_grpo_replay recipes/tiny_cpu_grpo.yaml "$STEPS" --set algorithm.routing_replay=true ;;
    refit)
      timeout 300 torchrun --standalone --nproc-per-node 1 benchmarks/reshard_latency.py --model qwen3-30b-a3b \
        --iters 20 --no-baseline --json "$OUT/reshard_qwen3_30b_a3b.json" 2>&1 | grep -v "^\s*$" | tail -15 ;;
    sglang)
      timeout 420 python3 benchmarks/sglang_refit.py --skip-tiny --model qwen3-30b-a3b --num-layers "$SGLANG_LAYERS" \
        --iters 10 --work /tmp/megarl-sgl --json "$OUT/sglang_refit_qwen3_30b_a3b.json" 2>&1 | grep -v "^\s*$" | tail -25 ;;
  esac
done
echo "[h200] done in $SECONDS s"

#!/usr/bin/env bash
# Colocation memory on H200s: $NPROC GPUs (2 on nvidia-h200-x2: TP2 trainer, two TP1 engines; 1 on one H200),
# with SGLang staged in /tmp/site (../shared/tools/sglang-h200) and megatron-core + rich carried in .whl/.
# Model: Llama-3-8B's body ($LAYERS of its 32 layers) with random bf16 weights and the tiny recipe's tokenizer
# (benchmarks/make_random_model.py). Runs, each into $OUT:
#   grpo:     GRPO with one TP1 SGLang engine per GPU at rollout.gpu_memory_fraction=$FRACTION (the 8B
#             recipe's), $STEPS_GRPO steps: the first wake after training is where it used to die
#   grpo_kept: the same with nothing offloaded (actor.offload_optimizer=false), as before offloading existed
#   alone:    the same engine alone on an empty GPU, for the KV cache it gets there
#   ppo:      KL-PPO with actor, critic and reference, TP=$NPROC DP1, $STEPS_PPO steps
#   ppo_auto: the same with rollout.gpu_memory_fraction=auto
#   ppo_auto_kept: ppo_auto with the actor's weights kept on the GPU while the engine generates
#   grpo_auto: grpo with rollout.gpu_memory_fraction=auto
#   grpo_auto_kept: grpo_auto with the actor's weights kept on the GPU while the engine generates, every
#             hand-over verified (rollout.verify_every=1)
#   grpo_death: grpo_auto with the engine's scheduler process killed (SIGKILL) after step 2: the run must end
#             with a megarl error naming the phase and a non-zero exit, not torchrun's SIGKILL report
#   grpo_sigterm: grpo_auto with torchrun sent SIGTERM after step 2 (scancel, a Slurm time limit): the run must end
#             as an interrupt (exit 143, "interrupted by SIGTERM"), not as an engine failure; the hand-over's parts
#             per step are in its metrics (handover/*_s)
#   grpo_alias: grpo_auto with the engine's weights mapping the actor's (rollout.alias_weights=true: one TP1 engine
#             per TP1 trainer), every hand-over verified (rollout.verify_every=1); grpo_alias_graphs: the same with
#             SGLang's CUDA graphs, captured on the actor's memory; grpo_copy (grpo_auto under this session's name) and
#             grpo_copy_kept (grpo_auto_kept unverified): the copying runs to compare KV cache and hand-over with
#   grpo_moe: GRPO on a tiny Qwen3-MoE (4 experts, top-2; the tiny recipe's tokenizer) with SGLang, every hand-over
#             into the engine's fused experts verified (rollout.verify_every=1)
# PART selects a subset (setup and the runs above; default setup grpo grpo_kept alone ppo) so that calls stay under 10 minutes.
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
PART=${PART:-setup grpo grpo_kept alone ppo}
FRACTION=${FRACTION:-0.7}
STEPS_GRPO=${STEPS_GRPO:-6}
STEPS_PPO=${STEPS_PPO:-10}
NPROC=${NPROC:-2}
LAYERS=${LAYERS:-32}
MODEL=${MODEL:-/tmp/llama8b}
source benchmarks/h200_common.sh
h200_session
BIG=(--set model.hf_path=$MODEL --set model.dtype=bfloat16 --set parallel.tensor_parallel=$NPROC
     --set rollout.gpu_memory_fraction=$FRACTION --set rollout.logprob_diff_max=2.0 --set tracking.backend=none)
# The runs from before rollout.alias_weights (its auto aliases a TP1 trainer into TP1 engines) copy, as they did.
COPY=(--set rollout.alias_weights=false)

for part in $PART; do
  case $part in
    setup)
      h200_setup
      python3 -c "import sglang; print('[h200] sglang', sglang.__version__)"
      python3 benchmarks/make_random_model.py --preset llama3-8b --tokenizer recipes/tiny/model --out $MODEL --layers "$LAYERS" ;;
    grpo)
      h200_train grpo recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" "${COPY[@]}" ;;
    grpo_kept)
      h200_train grpo_kept recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set actor.offload_optimizer=false "${COPY[@]}" ;;
    alone)
      # SGLang spawns its scheduler, which re-imports the main module: it must be a file.
      cat > /tmp/alone.py <<'PY'
import json, sys
if __name__ == "__main__":
    from megarl.rollout.sglang import SGLangEngine
    engine = SGLangEngine(sys.argv[1], gpu_memory_fraction=float(sys.argv[2]), dtype="bfloat16",
                          disable_cuda_graph=True, attention_backend="triton", sampling_backend="pytorch",
                          grammar_backend="none")
    info = engine.engine.get_server_info()
    print("ALONE", json.dumps({"max_total_num_tokens": info.get("max_total_num_tokens")}), flush=True)
    engine.shutdown()
PY
      timeout 300 python3 /tmp/alone.py "$MODEL" "$FRACTION" > "$OUT/alone.log" 2>&1
      echo "[h200] alone exit $?"; grep -h "ALONE\|KV Cache is allocated\|max_total_num_tokens=" "$OUT/alone.log" | cut -c1-400 ;;
    ppo)
      h200_train ppo recipes/tiny_cpu_ppo.yaml "$STEPS_PPO" "${COPY[@]}" ;;
    ppo_auto)
      h200_train ppo_auto recipes/tiny_cpu_ppo.yaml "$STEPS_PPO" --set rollout.gpu_memory_fraction=auto "${COPY[@]}" ;;
    ppo_auto_kept)
      h200_train ppo_auto_kept recipes/tiny_cpu_ppo.yaml "$STEPS_PPO" --set rollout.gpu_memory_fraction=auto \
        --set actor.offload_weights=false "${COPY[@]}" ;;
    grpo_auto|grpo_copy)
      h200_train "$part" recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set rollout.gpu_memory_fraction=auto "${COPY[@]}" ;;
    grpo_auto_kept)
      h200_train grpo_auto_kept recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set rollout.gpu_memory_fraction=auto \
        --set actor.offload_weights=false --set rollout.verify_every=1 "${COPY[@]}" ;;
    grpo_alias)
      h200_train grpo_alias recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set rollout.gpu_memory_fraction=auto \
        --set rollout.alias_weights=true --set rollout.verify_every=1 ;;
    grpo_alias_graphs)
      h200_train grpo_alias_graphs recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set rollout.gpu_memory_fraction=auto \
        --set rollout.alias_weights=true --set rollout.engine_args.disable_cuda_graph=false ;;
    grpo_copy_kept)
      h200_train grpo_copy_kept recipes/tiny_cpu_grpo.yaml "$STEPS_GRPO" --set rollout.gpu_memory_fraction=auto \
        --set actor.offload_weights=false "${COPY[@]}" ;;
    grpo_death)
      (for _ in $(seq 400); do grep -q "step 2/" "$OUT/grpo_death.log" 2>/dev/null && break; sleep 1; done
       pkill -9 -f "sglang::scheduler" && echo "[h200] killed the engine's scheduler after step 2") &
      h200_train grpo_death recipes/tiny_cpu_grpo.yaml 30 --set rollout.gpu_memory_fraction=auto
      tail -5 "$OUT/grpo_death.log" | cut -c1-600 ;;
    grpo_sigterm)
      (for _ in $(seq 400); do grep -q "step 2/" "$OUT/grpo_sigterm.log" 2>/dev/null && break; sleep 1; done
       pkill -TERM -f "bin/torchrun .*grpo_sigterm" && echo "[h200] sent SIGTERM to torchrun after step 2") &
      h200_train grpo_sigterm recipes/tiny_cpu_grpo.yaml 30 --set rollout.gpu_memory_fraction=auto
      grep -h "interrupted\|megarl error\|exitcode" "$OUT/grpo_sigterm.log" | cut -c1-300 ;;
    grpo_moe)
      python3 -c "
import shutil, sys; sys.path.insert(0, 'tests')
from pathlib import Path
from helpers import make_hf_model
out = Path('/tmp/moe')
make_hf_model(out, 'qwen3_moe', vocab_size=18, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
              num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=128, max_position_embeddings=64, eos_token_id=1, pad_token_id=0)  # SGLang's MoE rope: 64/128
for name in ('tokenizer.json', 'tokenizer_config.json', 'generation_config.json'):
    shutil.copy(Path('recipes/tiny/model') / name, out / name)"
      BIG=(--set model.hf_path=/tmp/moe --set model.dtype=bfloat16 --set rollout.gpu_memory_fraction=0.3
           --set rollout.logprob_diff_max=2.0 --set tracking.backend=none)
      h200_train grpo_moe recipes/tiny_cpu_grpo.yaml 8 --set rollout.verify_every=1 ;;
  esac
done
echo "[h200] done in $SECONDS s"

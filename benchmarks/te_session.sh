#!/usr/bin/env bash
# Transformer Engine and fast attention on one H200, written to $OUT. Expects (same machine, earlier calls):
# SGLang and megatron-core in /tmp/site (benchmarks/colocation_session.sh PART=setup, which also builds the
# extension and writes the random Llama-3-8B-body model to $MODEL), and TE 2.20.2 staged in /tmp/te
# (../shared/tools/te-h200: the five parts of transformer-engine-cu13 there, its last wheels in .te/last).
# Every run prints the layer classes it used, so a TE run cannot silently be a local-spec run.
#   parity:     bf16 logprobs/logits/critic values of tiny Llama/Qwen2/Qwen3 vs transformers, TE layers
#   throughput: training steps of the Llama-3-8B shape ($TRAIN_LAYERS layers, seq 4096, 8 micro-batches per
#               optimizer step) with TE, with the local spec on SDPA, and on Megatron's unfused attention
#   grpo_te:    the RL loop (GRPO, SGLang) on TE layers, every hand-over verified against the actor's weights
#   flex:       the GPU tests of the local spec's attention: FlexAttention on packed rows against SDPA's dense mask
#   gpu_tests:  flex's tests, and packed rows trained as padded ones on TE (THD format) and on the local spec
#   throughput_te: throughput's TE run alone
#   packing:    the actor's update on an RL-like length mix, packed rows against one padded sequence per row
#               (benchmarks/packing_throughput.py; Llama-3-8B body of $TRAIN_LAYERS layers, local spec)
#   packing_te: the same on TE's layers, packed rows in THD format
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
PART=${PART:-install parity throughput grpo_te}
TRAIN_LAYERS=${TRAIN_LAYERS:-8}
MODEL=${MODEL:-/tmp/llama8b}
source benchmarks/h200_common.sh
h200_session
export PYTHONPATH=/tmp/te_site:$PYTHONPATH
# TE must load torch's pip cuDNN, not the system's (../shared/tools/te-h200: an undefined symbol otherwise).
CUDNN_PATH=$(python3 -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])' 2>/dev/null)
export CUDNN_PATH LD_LIBRARY_PATH=$CUDNN_PATH/lib:${LD_LIBRARY_PATH:-}

throughput() {  # name [train_throughput flags]
  local name=$1; shift
  timeout 240 torchrun --standalone --nproc-per-node 1 benchmarks/train_throughput.py --model llama3-8b \
    --num-layers "$TRAIN_LAYERS" --seq 4096 --micro-batch 1 --num-micro-batches 8 --steps 8 \
    --json "$OUT/train_$name.json" "$@" 2>&1 | grep -v "^\s*$" | tail -3
}

for part in $PART; do
  case $part in
    install)
      cat /tmp/te/cu13.part* > /tmp/te/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/te_site /tmp/te/*.whl .te/last/*.whl \
        .te/last/deps/nvdlfw_inspect-*.whl .te/last/deps/importlib_metadata-*.whl
      python3 -c "import transformer_engine, megatron.core.extensions.transformer_engine; print('[h200] TE', transformer_engine.__version__)" ;;
    parity)
      PARITY_TE=1 bf16_parity parity_bf16_te ;;
    throughput)
      throughput te --te
      throughput sdpa --attention sdpa
      throughput unfused --attention unfused ;;
    grpo_te)
      start=$SECONDS
      timeout 300 torchrun --standalone --nproc-per-node 1 megarl/train.py --config recipes/tiny_cpu_grpo.yaml \
        --set model.hf_path=$MODEL --set model.dtype=bfloat16 --set model.transformer_engine=on \
        --set rollout.gpu_memory_fraction=auto --set rollout.verify_every=1 --set rollout.logprob_diff_max=2.0 \
        --set tracking.backend=none --set trainer.num_steps=4 --set checkpoint.dir=/tmp/grpo_te \
        "${SGLANG_ARGS[@]}" > "$OUT/grpo_te.log" 2>&1
      echo "[h200] grpo_te exit $? in $((SECONDS - start)) s"
      cp /tmp/grpo_te/metrics.jsonl "$OUT/grpo_te.metrics.jsonl" 2>/dev/null
      grep -h "megarl" "$OUT/grpo_te.log" | cut -c1-300 | tail -20 ;;
    flex)
      timeout 300 python3 -m pytest -q -m gpu tests/test_attention.py 2>&1 | tail -3 ;;
    gpu_tests)
      timeout 300 python3 -m pytest -q -s -m gpu tests/test_attention.py tests/test_packing_gpu.py 2>&1 \
        | grep -v "^\s*$" | grep -v -i "warn" | tail -12 ;;
    throughput_te)
      throughput te --te ;;
    packing | packing_te)
      [[ -f /tmp/llama8b_packing/config.json ]] || python3 benchmarks/make_random_model.py --preset llama3-8b \
        --tokenizer recipes/tiny/model --out /tmp/llama8b_packing --layers "$TRAIN_LAYERS"
      flags=(); [[ $part == packing_te ]] && flags=(--te)
      timeout 300 torchrun --standalone --nproc-per-node 1 benchmarks/packing_throughput.py --model /tmp/llama8b_packing \
        "${flags[@]}" --json "$OUT/${part/packing/packing_llama3_8b}.json" 2>&1 | grep -v "^\s*$" | tail -5 ;;
  esac
done
echo "[h200] done in $SECONDS s"

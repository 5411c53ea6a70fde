# Sourced by the H200 session scripts (run from the repository root).

# A session's log and environment: everything printed also goes to $OUT/log.txt; megatron-core (and a staged
# SGLang) come from /tmp/site; NVLink multicast stays off, as the lent H200 machines require.
h200_session() {
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/log.txt") 2>&1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
}

# megarl/train.py settings for SGLang 0.5.17 on this image (no CUDA graphs, triton attention, torch sampling).
SGLANG_ARGS=(--set rollout.engine=sglang --set rollout.engine_args.disable_cuda_graph=true
             --set rollout.engine_args.attention_backend=triton --set rollout.engine_args.sampling_backend=pytorch
             --set rollout.engine_args.grammar_backend=none)

# Record the machine in $OUT/env.txt, install the wheels carried in .whl/ (if any; benchmarks/h200_stage.sh packs
# its own) into /tmp/site (where a staged SGLang also lives) and build the extension against the machine's torch.
h200_setup() {
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V;
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; cat .git_rev 2>/dev/null; } \
    > "$OUT/env.txt"
  [[ -d .whl ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
  local start=$SECONDS
  python3 -m pip install -q --no-build-isolation --no-deps -e . && echo "[h200] extension built in $((SECONDS - start)) s"
}

# Logprobs and logits of tiny random bf16 Llama/Qwen2/Qwen3 models against transformers (TP1 PP1, one GPU),
# written to $OUT/${1:-parity_bf16}.json (PARITY_TE=1: Transformer Engine's layers).
bf16_parity() {
  local name=${1:-parity_bf16}
  echo "== bf16 parity vs transformers (TP1 PP1, one GPU)"
  mkdir -p /tmp/parity/out
  timeout 60 python3 -c "
import sys, torch; sys.path.insert(0, 'tests')
from pathlib import Path
from helpers import make_hf_model
make_hf_model(Path('/tmp/parity/llama'), 'llama', dtype=torch.bfloat16)
make_hf_model(Path('/tmp/parity/qwen2'), 'qwen2', dtype=torch.bfloat16)
make_hf_model(Path('/tmp/parity/qwen3'), 'qwen3', dtype=torch.bfloat16)"
  PARITY_DTYPE=bfloat16 timeout 180 torchrun --standalone --nproc-per-node 1 tests/workers/parity.py /tmp/parity/out \
    /tmp/parity/llama /tmp/parity/qwen2 /tmp/parity/qwen3 && cp /tmp/parity/out/rank0.json "$OUT/$name.json" && cat "$OUT/$name.json"
}

# One megarl/train.py run on $NPROC GPUs with SGLang, named $1, into $OUT (log, metrics, engine logs, host memory
# every 5 s): h200_train NAME RECIPE STEPS [--set ...]; the model and layout settings come from the array BIG.
h200_train() {
  local name=$1 recipe=$2 steps=$3; shift 3
  local start=$SECONDS
  # The node's host memory in use, every 5 s: pinned offload buffers live there.
  (while sleep 5; do free -m | awk -v t=$((SECONDS - start)) 'NR==2 {print t, $3}'; done) > "$OUT/$name.host_mib.txt" &
  local sampler=$!
  timeout "${RUN_TIMEOUT:-540}" torchrun --standalone --nproc-per-node "$NPROC" megarl/train.py --config "$recipe" "${BIG[@]}" "${SGLANG_ARGS[@]}" \
    --set trainer.num_steps="$steps" --set checkpoint.dir=/tmp/$name "$@" > "$OUT/$name.log" 2>&1
  echo "[h200] $name exit $? in $((SECONDS - start)) s"
  kill $sampler
  echo "[h200] $name host memory peak $(sort -k2 -n "$OUT/$name.host_mib.txt" | tail -1 | cut -d' ' -f2) MiB of $(free -m | awk 'NR==2 {print $2}')"
  cp /tmp/$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
  for f in /tmp/$name/engine_*.log; do [[ -f $f ]] && tail -c 200000 "$f" > "$OUT/$name.$(basename "$f")"; done
  grep -h "megarl error\|KV Cache is allocated\|max_total_num_tokens=" "$OUT/$name.log" | cut -c1-400
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
}


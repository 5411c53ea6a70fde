#!/usr/bin/env bash
# Asynchronous RL (issue 37) and on-policy distillation (issue 39) on one H200: SmolLM2-135M-Instruct on the arith
# task with SGLang 0.5.17 and CUDA graphs, every run from the same start and seeds, held-out greedy accuracy on
# recipes/arith/test.jsonl (500 prompts) before the first step and every $EVAL_EVERY steps.
#
# What travels: `bash benchmarks/h200_stage.sh pack` (here) cuts SGLang, megatron-core, math-verify, pytest and the
# SmolLM2 GGUF into .stage/p1 ... .stage/pN and prints the calls, one part each. Parts, each into $OUT:
#   stage N   copy .stage/pN into /tmp/stage (N=1 also builds the extension; carry .stage/pN)
#   install   install what was staged and convert the GGUF to /tmp/smollm2 (after the last part)
#   start     start $RUNS in the background, one after another, in a session of their own (they outlive the call)
#   wait      wait up to $WAIT s for the runs to end; copy every run's log and metrics into $OUT/runs.tar.gz
# The runs (RUNS, in order):
#   sync      GRPO (recipes/smollm2_gsm8k_grpo.yaml on arith), $STEPS steps; its last checkpoint, exported with
#             mcore-to-hf, is the teacher
#   ppo       KL-PPO (recipes/smollm2_gsm8k_ppo.yaml: actor, critic, reference, GAE) on arith, $STEPS steps
#   async     the same with async_rl.mode colocated_async (chunks of $CHUNK tokens, max_staleness 1, token_tis)
#   opd       the base model distilled from that teacher with no reward (recipes/smollm2_arith_opd.yaml)
#   gsm8k_sync, gsm8k_async   $GSM8K_STEPS steps of the GSM8K recipe itself, sync and colocated_async
#   async_radix, gsm8k_async_radix   colocated_async with SGLang's radix cache on (the recipe turns it off)
#   separate, gsm8k_separate   async_rl.mode separate (the engine resident beside the trainer), radix cache on
#   async_abort, gsm8k_async_abort   colocated_async without chunks: SGLang aborts the unfinished requests once a
#             batch is done (async_rl.chunk_tokens null)
#   separate_abort, gsm8k_separate_abort   separate without chunks (aborted for each weight push)
#   product_tool   GRPO with the sandboxed Python tool on three-digit products (recipes/smollm2_product_tool_grpo.yaml),
#             $STEPS steps, held-out accuracy and tool calls (agent/*) every $EVAL_EVERY steps
#   arith_bf16, arith_fp8   issue 54 on the real model: sync GRPO on arith from the same start and seeds with token
#             TIS, the engine in bf16 or in block FP8 (64 x 64 blocks: SmolLM2's 576 and 192 rows are not multiples of
#             128), $STEPS steps: held-out accuracy, rollout_correction/* (the sampler's gap and the TIS weights)
#   product_notool   the base model on the same held-out products without the tool (megarl.evaluate, greedy)
#   lora8b    Llama-3-8B's body (32 layers, random weights, SmolLM2's tokenizer) with LoRA rank 64 on every linear
#             layer, $STEPS_8B GRPO steps of the GSM8K recipe at $PROMPTS_8B (32) prompts x 8 samples of up to 256 tokens
#             (64: the recipe's own 512 sequences in flight), merged
#             hand-over: memory/* per phase, time/* and handover/* in its metrics
#   lora8b_fp8   lora8b with the engine in block FP8 (rollout.weight_dtype fp8, token_tis): tokens/s, KV cache and
#             the hand-over's time into FP8 against lora8b's, and the FP8 sampler's gap (rollout_correction/*)
#   lora8b_adapter   lora8b with actor.lora.handover adapter: SGLang serves the adapters over base weights that
#             alias the actor's (hand-over time, tokens/s and KV cache against lora8b's merged hand-over)
#   tool_gsm8k   GRPO with the Python tool on GSM8K (recipes/smollm2_gsm8k_tool_grpo.yaml), $TOOL_STEPS steps,
#             held-out GSM8K accuracy (500 prompts) before the first step and after the last
#   gputests  the GPU tests $TESTS (pytest -m gpu) on the staged SGLang with the converted SmolLM2, into gputests.log
#   full8b    the same body at $FULL_LAYERS layers (16; 14 on an H100: the memory plan puts 16 at 84.7 GiB in the
#             update), every weight trained (the optimizer offloaded while the engine generates)
#   any GSM8K run with _wide after its mode (e.g. gsm8k_sync_wide): micro-batches of $WIDE tokens (the recipe's 65536)
#   any async or separate run with _stale2 after its mode (e.g. gsm8k_separate_abort_stale2_mps): max_staleness 2
#   any GSM8K run with _noprefill before _mps (e.g. gsm8k_sync_noprefill): SGLang without prefill CUDA graphs, whose
#             capture is most of the engine's start on a fresh machine (the GSM8K recipe's default since 10052c2's runs)
#   any of them with _mps at the end (e.g. gsm8k_separate_mps): under NVIDIA's Multi-Process Service, which lets
#             the kernels of the engine's and the learner's processes run at once instead of taking turns
# start runs the tree it finds, or the one in .stage/tree.tgz where that is carried (`git archive HEAD | gzip`), so
# that later calls, which carry the working tree as it is then, cannot change the runs under way.
# PROFILE=STEP traces that step of every GSM8K run (train.py --profile) and writes its per-phase summary
# (benchmarks/trace_summary.py) beside the run's metrics as trace_summary.txt.
# Part cache-save leaves the runs' compiled kernels in $OUT (benchmarks/h200_stage.sh cache-save).
# Parts mps (probe that MPS starts here and serves a CUDA process) and test (below) can join a stage call.
# A further part, test, runs the GPU tests $TESTS (those of SGLang's abort, tests/test_rollout_sglang_gpu.py, unless
# set) at once, as the gputests run does in the background (after install).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
PART=${PART:?set PART}
STEPS=${STEPS:-30}
EVAL_EVERY=${EVAL_EVERY:-5}
CHUNK=${CHUNK:-64}
GSM8K_STEPS=${GSM8K_STEPS:-8}
STEPS_8B=${STEPS_8B:-4}
PROMPTS_8B=${PROMPTS_8B:-32}
TOOL_STEPS=${TOOL_STEPS:-10}
TESTS=${TESTS:-tests/test_rollout_sglang_gpu.py}
FULL_LAYERS=${FULL_LAYERS:-16}
GSM8K_EVAL_EVERY=${GSM8K_EVAL_EVERY:-0}
WIDE=${WIDE:-131072}
RUNS=${RUNS:-sync async opd gsm8k_sync gsm8k_async}
source benchmarks/h200_common.sh
source benchmarks/h200/stage.sh
h200_session

export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log

mps_start() {
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" && nvidia-cuda-mps-control -d && sleep 1
}

mps_stop() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 2
}

# megarl/train.py on one GPU into /tmp/runs/NAME, its log's lines stamped with the seconds since its start; a
# NAME ending in _mps runs under MPS.
learn() {
  local name=$1 recipe=$2; shift 2
  local start=$SECONDS
  [[ $name == *_mps ]] && { mps_start || echo "[h200] MPS did not start"; }
  echo "[h200] $name started at $(date -u +%T)"
  # TORCH_LOGS=recompiles: what the first steps still compile (megarl compiles attention ahead, beside the engine)
  TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout "${RUN_TIMEOUT:-900}" torchrun --standalone --nproc-per-node 1 megarl/train.py --config "$recipe" \
    --set model.hf_path=/tmp/smollm2 --set tracking.backend=none --set rollout.engine_args.grammar_backend=none \
    --set checkpoint.dir=/tmp/runs/$name "$@" 2>&1 | while IFS= read -r l; do echo "[$((SECONDS - start))s] $l"; done \
    > /tmp/runs/$name.log
  echo "[h200] $name exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
  [[ $name == *_mps ]] && mps_stop
  grep -E "eval arith|megarl error" /tmp/runs/$name.log | cut -c1-240 | tail -8
  local trace
  for trace in /tmp/runs/"$name"/profile_step*_rank0.json; do
    [[ -f $trace ]] && python3 benchmarks/trace_summary.py "$trace" | tee /tmp/runs/"$name"/trace_summary.txt
  done
}

ARITH=(--set data.train_path=recipes/arith/train.jsonl --set rollout.max_new_tokens=256
       --set eval.every="$EVAL_EVERY" --set 'eval.datasets=[{name: arith, path: recipes/arith/test.jsonl}]')
ASYNC=(--set async_rl.mode=colocated_async --set async_rl.chunk_tokens="$CHUNK"
       --set algorithm.rollout_correction=token_tis)
RADIX=(--set rollout.engine_args.disable_radix_cache=false)
SEPARATE=(--set async_rl.mode=separate --set async_rl.chunk_tokens="$CHUNK" --set algorithm.rollout_correction=token_tis
          "${RADIX[@]}" --set rollout.gpu_memory_fraction=0.4)
ABORT=(--set async_rl.mode=colocated_async --set async_rl.chunk_tokens=null --set algorithm.rollout_correction=token_tis)
SEPARATE_ABORT=(--set async_rl.mode=separate --set async_rl.chunk_tokens=null
                --set algorithm.rollout_correction=token_tis --set rollout.gpu_memory_fraction=0.4)

# The async_rl settings of run $1 (into sets), the same for an arith run and its gsm8k_ twin; none for sync.
mode_sets() {
  local run=${1#gsm8k_} stale=() prefill=()
  run=${run%_mps}
  # SGLang's prefill CUDA graphs (58 token counts up to 8192, captured and compiled at start) left out
  [[ $run == *_noprefill ]] && { prefill=(--set rollout.engine_args.cuda_graph_backend_prefill=disabled); run=${run%_noprefill}; }
  [[ $run == *_stale2 ]] && { stale=(--set async_rl.max_staleness=2); run=${run%_stale2}; }
  case ${run%_wide} in
    async) sets=("${ASYNC[@]}") ;; async_radix) sets=("${ASYNC[@]}" "${RADIX[@]}") ;;
    async_abort) sets=("${ABORT[@]}") ;; separate) sets=("${SEPARATE[@]}") ;;
    separate_abort) sets=("${SEPARATE_ABORT[@]}") ;; *) sets=() ;;
  esac
  [[ $run == *_wide ]] && sets+=(--set actor.max_tokens_per_gpu="$WIDE")
  sets+=("${stale[@]}" "${prefill[@]}")
  return 0
}

# The GPU tests $TESTS on the staged SGLang with the converted SmolLM2, into /tmp/runs/gputests.log.
gpu_tests() {
  mkdir -p /tmp/runs
  MEGARL_TEST_HF_MODEL=/tmp/smollm2 timeout "${TEST_TIMEOUT:-600}" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    $TESTS > /tmp/runs/gputests.log 2>&1
  echo "[h200] gputests exit $?: $(tail -1 /tmp/runs/gputests.log | cut -c1-300)"
}

all_runs() {
  mkdir -p /tmp/runs
  for run in $RUNS; do
    case ${run%_mps} in
      gsm8k_*)
        mode_sets "$run"
        learn "$run" recipes/smollm2_gsm8k_grpo.yaml "${sets[@]}" --set trainer.num_steps="$GSM8K_STEPS" \
          --set eval.before_train=false --set eval.every="$GSM8K_EVAL_EVERY" --set checkpoint.save_every=0 \
          ${PROFILE:+--profile "$PROFILE"} ;;
      sync)
        learn sync recipes/smollm2_gsm8k_grpo.yaml "${ARITH[@]}" --set trainer.num_steps="$STEPS" \
          --set checkpoint.save_every="$STEPS"
        last=$(ls -d /tmp/runs/sync/step_*/actor | sort | tail -1)
        python3 -m megarl.convert mcore-to-hf --ckpt "$last" --out /tmp/teacher 2>&1 | tail -2 ;;
      ppo)
        learn ppo recipes/smollm2_gsm8k_ppo.yaml "${ARITH[@]}" --set trainer.num_steps="$STEPS" \
          --set checkpoint.save_every=0 ;;
      async|async_radix|separate|async_abort|separate_abort|*_stale2)
        mode_sets "$run"
        learn "$run" recipes/smollm2_gsm8k_grpo.yaml "${ARITH[@]}" "${sets[@]}" --set trainer.num_steps="$STEPS" \
          --set checkpoint.save_every=0 ;;
      arith_bf16|arith_fp8)
        local fp8=()
        [[ $run == arith_fp8 ]] && fp8=(--set rollout.weight_dtype=fp8 --set rollout.fp8_block=64)
        learn "$run" recipes/smollm2_gsm8k_grpo.yaml "${ARITH[@]}" --set algorithm.rollout_correction=token_tis \
          "${fp8[@]}" --set trainer.num_steps="$STEPS" --set checkpoint.save_every=0 ;;
      product_tool)
        learn product_tool recipes/smollm2_product_tool_grpo.yaml --set trainer.num_steps="$STEPS" \
          --set eval.every="$EVAL_EVERY" --set checkpoint.save_every=0 ;;
      product_notool)
        timeout 600 python3 -m megarl.evaluate --model /tmp/smollm2 --data recipes/product/test.jsonl --engine sglang \
          --prompt-template "{question} Output the final answer after \"####\"." --max-new-tokens 256 \
          --engine-arg attention_backend=triton --engine-arg sampling_backend=pytorch \
          --engine-arg grammar_backend=none > /tmp/runs/product_notool.log 2>&1
        echo "[h200] product_notool exit $?: $(tail -1 /tmp/runs/product_notool.log | cut -c1-300)" ;;
      tool_gsm8k)
        learn tool_gsm8k recipes/smollm2_gsm8k_tool_grpo.yaml --set trainer.num_steps="$TOOL_STEPS" \
          --set eval.every="$TOOL_STEPS" --set checkpoint.save_every=0 ;;
      gputests)
        gpu_tests ;;
      lora8b|lora8b_fp8|lora8b_adapter|full8b)
        local layers=32 lora=(--set actor.lora.rank=64 --set actor.lora.alpha=128)
        [[ $run == full8b ]] && { layers=$FULL_LAYERS; lora=(); }
        [[ $run == lora8b_adapter ]] && lora+=(--set actor.lora.handover=adapter)
        [[ $run == lora8b_fp8 ]] && lora+=(--set rollout.weight_dtype=fp8 --set algorithm.rollout_correction=token_tis)
        [[ -f /tmp/llama8b_$layers/config.json ]] || python3 benchmarks/make_random_model.py --preset llama3-8b \
          --tokenizer /tmp/smollm2 --out /tmp/llama8b_$layers --layers $layers 2>&1 | tail -1
        learn "$run" recipes/smollm2_gsm8k_grpo.yaml --set model.hf_path=/tmp/llama8b_$layers "${lora[@]}" \
          --set model.recompute_activations=true --set actor.max_tokens_per_gpu=16384 --set actor.dynamic_batch=true \
          --set data.num_prompts_per_step="$PROMPTS_8B" --set rollout.max_new_tokens=256 \
          --set trainer.num_steps="$STEPS_8B" --set eval.before_train=false --set eval.every=0 \
          --set checkpoint.save_every=0 ;;
      opd)
        learn opd recipes/smollm2_arith_opd.yaml --set distill.teacher=/tmp/teacher --set rollout.max_new_tokens=256 \
          --set eval.every="$EVAL_EVERY" --set trainer.num_steps="$STEPS" --set checkpoint.save_every=0 ;;
    esac
  done
}

for part in $PART; do case $part in
  stage)
    stage_copy "${N:?set N}" ;;
  install)
    stage_install ;;
  start)
    # Run the committed tree packed here, not what later calls carry. The device keeps an ignored file between calls,
    # so the packed tree is removed once unpacked: a later start without it runs its own call's tree.
    if [[ -f .stage/tree.tgz ]]; then
      rm -rf /tmp/tree && mkdir -p /tmp/tree && tar xzf .stage/tree.tgz -C /tmp/tree && rm .stage/tree.tgz &&
        cp megarl/_C*.so /tmp/tree/megarl/ &&
        cp .git_rev /tmp/tree/ 2>/dev/null; cd /tmp/tree && echo "[h200] runs from /tmp/tree: $(cat .git_rev 2>/dev/null)"
    fi
    export PYTHONPATH=/tmp/site:$PWD
    rm -f /tmp/runs.done  # an earlier start's: wait would take these runs for done at once
    setsid nohup bash -c "OUT=/tmp/runs_out PART=runs RUNS='$RUNS' STEPS=$STEPS EVAL_EVERY=$EVAL_EVERY CHUNK=$CHUNK \
      GSM8K_STEPS=$GSM8K_STEPS STEPS_8B=$STEPS_8B PROMPTS_8B=$PROMPTS_8B TOOL_STEPS=$TOOL_STEPS TESTS='$TESTS' FULL_LAYERS=$FULL_LAYERS GSM8K_EVAL_EVERY=$GSM8K_EVAL_EVERY WIDE=$WIDE PROFILE=${PROFILE:-} bash benchmarks/h200_async_opd.sh; touch /tmp/runs.done" > /dev/null 2>&1 < /dev/null &
    echo "[h200] runs started: $RUNS" ;;
  runs)
    all_runs ;;
  cache-save)  # after the runs: their compiled kernels for the next session (benchmarks/h200_stage.sh)
    cache_save ;;
  mps)
    mps_start && python3 -c "import torch; print('[h200] a CUDA process under MPS:', (torch.ones(4, device='cuda') * 2).sum().item())" \
      && echo get_server_list | nvidia-cuda-mps-control && mps_stop && echo "[h200] MPS works here" \
      || { echo "[h200] MPS does not work here"; cat "$CUDA_MPS_LOG_DIRECTORY"/*.log 2>/dev/null | tail -5; mps_stop; } ;;
  test)
    export PYTHONPATH=/tmp/site:$PWD
    gpu_tests && tail -40 /tmp/runs/gputests.log ;;
  wait)
    for _ in $(seq "${WAIT:-0}"); do [[ -f /tmp/runs.done ]] && break; sleep 1; done
    [[ -f /tmp/runs.done ]] && echo "[h200] all runs done" || echo "[h200] still running"
    cat /tmp/runs_out/log.txt
    for f in /tmp/runs/*.log; do echo "== $f"; grep -E "\] step|megarl error" "$f" | tail -3 | cut -c1-330; done
    (cd /tmp/runs && tar czf "$OUT/runs.tar.gz" --exclude='step_*' --exclude='*.pt' ./*.log ./*/metrics.jsonl \
      ./*/engine_*.log ./*/trace_summary.txt 2>/dev/null) ;;
esac; done

#!/usr/bin/env bash
# Reliability on one H200 with SGLang staged in /tmp/site (../shared/tools/sglang-h200) and megatron-core carried
# in .whl/ (issue: correctness and reliability, round two). Runs, each into $OUT:
#   setup:     record the machine, install .whl/, build the extension
#   truncated: which distribution SGLang's logprobs belong to under top-p/top-k (benchmarks/truncated_logprobs.py)
#   exit:      GRPO on the tiny recipe with SGLang, $STEPS steps: a finished run prints no traceback or CUDA IPC
#              warning (counted in $OUT/exit.log)
#   kill9:     the same run, its trainer killed with SIGKILL after step 1: the engine's processes must be gone and
#              the GPU's memory free within seconds ($OUT/kill9.log lists what is left)
#   hang:      the same run with SGLang's scheduler hanging while it starts (.diag/sitecustomize.py, MEGARL_DIAG_HANG):
#              the run must end at rollout.timeout_minutes with one paragraph, exit 2, no process left
#   rollout:   benchmarks/rollout_speed.py on SmolLM2 (converted by learn), triton and flashinfer backends
#   learn:     SmolLM2-135M-Instruct (converted here from the GGUF, whose parts earlier calls copied into /tmp/gguf)
#              trained with recipes/smollm2_gsm8k_$LEARN_ALGO.yaml (grpo, ppo or tool_grpo) on $LEARN_TRAIN (default:
#              the arith task) for $LEARN_STEPS steps with CUDA graphs, held-out greedy accuracy on arith and GSM8K
#              every $EVAL_EVERY steps. BG=1 starts it in the background and returns; part `collect` waits for it.
#   update:    benchmarks/update_memory.py: scoring's and the actor update's peaks and tokens/s with the full logits
#              and the chunked path, SmolLM2 (converted by learn) or Llama-3-8B's body at 16 layers ($UPDATE_MODEL)
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
    kill9)
      timeout 300 torchrun --standalone --nproc-per-node 1 megarl/train.py --config recipes/tiny_cpu_grpo.yaml \
        "${TINY[@]}" --set trainer.num_steps=50 --set checkpoint.dir=/tmp/kill9 > "$OUT/kill9.log" 2>&1 &
      for _ in $(seq 240); do [[ -s /tmp/kill9/metrics.jsonl ]] && break; sleep 0.5; done
      engines=$(pgrep -f "multiprocessing.spawn|sglang" | wc -l)
      worker=$(pgrep -f "^[^ ]*python[^ ]* -u megarl/train.py|^[^ ]*python[^ ]* megarl/train.py" | head -1)
      echo "[h200] kill9: $engines engine processes while step 1 runs; kill -9 trainer $worker"
      kill -9 "$worker"; start=$SECONDS
      for _ in $(seq 60); do (( $(pgrep -f "multiprocessing.spawn|sglang" | wc -l) == 0 )) && break; sleep 0.5; done
      echo "[h200] kill9: engine processes left after $((SECONDS - start)) s: $(pgrep -f 'multiprocessing.spawn|sglang' | wc -l)"
      ps -eo pid,ppid,etimes,rss,args | grep -E "spawn|sglang" | grep -v grep | cut -c1-200 >> "$OUT/kill9.log"
      wait; nvidia-smi --query-gpu=memory.used --format=csv ;;
    hang)
      export PYTHONPATH=$PWD/.diag:$PYTHONPATH
      start=$SECONDS
      MEGARL_DIAG_HANG=1 timeout 300 torchrun --standalone --nproc-per-node 1 megarl/train.py \
        --config recipes/tiny_cpu_grpo.yaml "${TINY[@]}" --set rollout.timeout_minutes=1 \
        --set checkpoint.dir=/tmp/hang > "$OUT/hang.log" 2>&1
      echo "[h200] hang: exit $? after $((SECONDS - start)) s; engine processes left: $(pgrep -f 'multiprocessing.spawn|sglang' | wc -l)"
      grep "megarl error" "$OUT/hang.log" | cut -c1-600 ;;
    learn)
      # The GGUF arrives in parts, one per call (.gguf/gN carried, copied into /tmp/gguf); gguf comes with SGLang.
      name=learn_${LEARN_ALGO:-grpo}
      if [[ ! -d /tmp/smollm2 ]]; then
        cat /tmp/gguf/smollm2.gguf.* > /tmp/smollm2.gguf
        echo "[h200] gguf sha256 $(sha256sum /tmp/smollm2.gguf | cut -c1-16) (b179c9523d0e6a0f expected)"
        python3 -m megarl.convert gguf-to-hf --gguf /tmp/smollm2.gguf --out /tmp/smollm2 2>&1 | tail -1
      fi
      cmd=(timeout "${LEARN_TIMEOUT:-540}" torchrun --standalone --nproc-per-node 1 megarl/train.py
        --config "recipes/smollm2_gsm8k_${LEARN_ALGO:-grpo}.yaml" --set model.hf_path=/tmp/smollm2
        --set tracking.backend=none --set data.train_path="${LEARN_TRAIN:-recipes/arith/train.jsonl}"
        --set trainer.num_steps="${LEARN_STEPS:-60}" --set eval.every="${EVAL_EVERY:-10}"
        --set rollout.max_new_tokens="${LEARN_MAX_NEW:-256}"
        --set 'eval.datasets=[{name: arith, path: recipes/arith/test.jsonl}, {name: gsm8k, path: "gsm8k:test", max_prompts: 500}]'
        --set rollout.engine_args.attention_backend=triton --set rollout.engine_args.sampling_backend=pytorch
        --set rollout.engine_args.grammar_backend=none --set checkpoint.dir=/tmp/$name --set checkpoint.save_every=0
        ${LEARN_SETS:-})
      if [[ -n ${BG:-} ]]; then
        # Its own session, so that it outlives this call; the seconds since its start go with each line of its log.
        setsid nohup bash -c 'start=$SECONDS; "$@" 2>&1 | while IFS= read -r l; do echo "[$((SECONDS - start))s] $l"; \
          done > /tmp/$0.log; echo "${PIPESTATUS[0]} $((SECONDS - start))" > /tmp/$0.rc' "$name" "${cmd[@]}" \
          > /dev/null 2>&1 < /dev/null &
        echo "[h200] $name started in the background"
        continue
      fi
      start=$SECONDS
      "${cmd[@]}" > "$OUT/$name.log" 2>&1
      echo "[h200] $name exit $? after $((SECONDS - start)) s"; cp /tmp/$name/metrics.jsonl "$OUT/$name.metrics.jsonl"
      grep -E "^step|eval " "$OUT/$name.log" | cut -c1-300 | tail -30 ;;
    collect)
      # A background learn run: wait up to $WAIT s for it to end, then keep its log and metrics.
      name=learn_${LEARN_ALGO:-grpo}
      for _ in $(seq "${WAIT:-0}"); do [[ -f /tmp/$name.rc ]] && break; sleep 1; done
      echo "[h200] $name: $(cat /tmp/$name.rc 2>/dev/null || echo running) (exit code, seconds)"
      cp /tmp/$name.log "$OUT/$name.log"; cp /tmp/$name/metrics.jsonl "$OUT/$name.metrics.jsonl" 2>/dev/null
      grep -E "\] step|eval " "$OUT/$name.log" | cut -c1-300 | tail -${TAIL:-12} ;;
    update)
      # $UPDATE_MODEL: smollm2 (converted by learn) at 32k and 128k tokens per micro-batch, or llama (Llama-3-8B's
      # body at 16 layers, random weights) at 8k and 32k; each with and without activation recomputation. The full
      # logits run at the smaller budget only: at the larger one they do not fit.
      if [[ ${UPDATE_MODEL:-smollm2} == smollm2 ]]; then model=(--model /tmp/smollm2); small=32768; large=131072
      else model=(--model llama3-8b --num-layers 16 --samples 256); small=8192; large=32768; fi
      for recompute in ${UPDATE_RECOMPUTE:-false true}; do
        for chunk in 0 1024; do
          name=update_memory_${UPDATE_MODEL:-smollm2}_chunk${chunk}_recompute_$recompute
          budgets=(--tokens $small); [[ $chunk != 0 ]] && budgets+=(--tokens $large)
          [[ $chunk != 0 && $recompute == false && ${UPDATE_MODEL:-smollm2} == llama ]] && budgets=(--tokens $small)
          timeout 200 torchrun --standalone --nproc-per-node 1 benchmarks/update_memory.py "${model[@]}" \
            --chunk $chunk "${budgets[@]}" --set model.recompute_activations=$recompute --json "$OUT/$name.json" \
            > "$OUT/$name.log" 2>&1
          echo "[h200] $name exit $?"; grep '^{' "$OUT/$name.log" | cut -c1-420
        done
      done ;;
    rollout)
      # megarl's adapter against the bare SGLang engine on SmolLM2 (issue: rollout at the engine's speed)
      for backend in "triton pytorch" "flashinfer flashinfer"; do
        set -- $backend
        timeout 400 python3 benchmarks/rollout_speed.py --model /tmp/smollm2 --data recipes/arith/train.jsonl \
          --prompts 64 --samples 8 --max-new-tokens 256 --engine sglang --engine-arg attention_backend=$1 \
          --engine-arg sampling_backend=$2 --engine-arg grammar_backend=none --json "$OUT/rollout_speed_$1.json" \
          > "$OUT/rollout_speed_$1.log" 2>&1
        echo "[h200] rollout_speed $1/$2 exit $?"; grep -A3 '"bare\|"adapter' "$OUT/rollout_speed_$1.json"
      done ;;
  esac
done

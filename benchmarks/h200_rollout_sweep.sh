#!/usr/bin/env bash
# SGLang's generation speed on one H200 over engine settings (issue 38, item 1): benchmarks/rollout_speed.py once
# per setting (the bare engine against megarl's adapter, on one engine), with SGLang's own decode log (batch,
# tokens/s and GPU occupancy every 40 steps) read by benchmarks/sglang_decode_log.py.
# SGLang 0.5.17 and SmolLM2-135M-Instruct's GGUF travel as `bash benchmarks/h200_stage.sh pack` cuts them (here; it
# prints the calls), .stage/p1 ... .stage/pN, one call each:
#   bash benchmarks/h200_rollout_sweep.sh STEP...   with OUT set; steps, in order:
#     stageN   copy .stage/pN into /tmp/stage (stage1 also builds the extension)
#     wheels   install what was staged into /tmp/site and convert the GGUF to /tmp/smollm2, in the background (after
#              the last part); with FIWARM=1 then compile flashinfer's JIT attention kernels for SmolLM2 (8 compile
#              jobs): a setting named fi* waits for that while time allows
#     convert  record the machine in /tmp/rs/env.txt and wait for the install
#     sweep    MODEL=smollm2 (the converted model) or llamaN (Llama-3-8B's body at N layers, SmolLM2's tokenizer,
#              random weights: load_format=dummy; llamaNfp8: its linear layers in SGLang's block-FP8 format); CONFIGS="name:key=value/key=value name2:..." one engine each,
#              on top of COMMON (variants=a,b and repeats=N in a setting override VARIANTS and REPEATS);
#              attention_backend=fa3 in a setting needs the parts packed with FA3=1 (benchmarks/h200_stage.sh);
#              DATA and TEMPLATE (the GSM8K recipe's: gsm8k and its prompt template); VARIANTS (bare-n1,adapter),
#              REPEATS (2); a setting gets TCFG s at most (260);
#              DEADLINE (s since the call began, 570): a setting with less than 100 s left is skipped;
#              profile=N in a setting traces N decode steps of one more pass (rollout_speed.py --profile) and prints
#              where a step's time goes (benchmarks/decode_trace_summary.py, into NAME.trace.txt)
# Results: /tmp/rs/MODEL_NAME.{json,log,decode.json}, packed into $OUT/rollout_sweep.tgz after each setting.
# As run (benchmarks/results/h200/rollout_speed), before h200_stage.sh: five calls carrying SGLang's four parts and the
# GGUF's five slices by hand (benchmarks/results/h200/rollout_speed/README.md).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
source benchmarks/h200_common.sh
source benchmarks/h200/stage.sh
h200_session
COMMON=${COMMON:-attention_backend=triton/sampling_backend=pytorch/grammar_backend=none}
DATA=${DATA:-gsm8k}
TEMPLATE=${TEMPLATE-"{question} Let's think step by step and output the final answer after \"####\"."}
mkdir -p /tmp/rs

warm_flashinfer() {
  MAX_JOBS=8 timeout 1500 python3 benchmarks/rollout_speed.py --model /tmp/smollm2 --data gsm8k \
    --prompts 1 --samples 2 --max-new-tokens 8 --repeats 0 --variants bare --gpu-memory-fraction 0.08 \
    --engine-arg load_format=dummy --engine-arg attention_backend=flashinfer --engine-arg sampling_backend=flashinfer \
    --engine-arg grammar_backend=none --engine-arg disable_cuda_graph=true > /tmp/rs/fiwarm.log 2>&1
  echo $? > /tmp/fiwarm.rc
}

for step in "$@"; do
  case $step in
    stage*)
      stage_copy "${step#stage}" ;;
    wheels)
      # In a session of its own, so that the call can go on to convert's wait (or end); then (FIWARM=1) compile
      # flashinfer's JIT attention kernels for SmolLM2's shapes on a small engine with random weights and no CUDA
      # graphs, cached for a later fi* setting.
      setsid nohup bash -c "source benchmarks/h200_common.sh; source benchmarks/h200/stage.sh; $(declare -f warm_flashinfer)
        (stage_install); echo \$? > /tmp/wheels.rc; [[ -n '${FIWARM:-}' ]] && warm_flashinfer" > /tmp/wheels.log 2>&1 < /dev/null &
      echo "[sweep] installing and converting in the background${FIWARM:+, then compiling the flashinfer kernels}" ;;
    convert)
      start=$SECONDS
      { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc;
        python3 -V; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
        > /tmp/rs/env.txt
      for _ in $(seq 300); do [[ -f /tmp/wheels.rc ]] && break; sleep 1; done
      echo "[sweep] install: exit $(cat /tmp/wheels.rc 2>/dev/null || echo 'still running'); $(tail -2 /tmp/wheels.log)"
      python3 -c "import sglang; print('[sweep] sglang', sglang.__version__)" 2>&1 | tail -1 | tee -a /tmp/rs/env.txt
      echo "[sweep] install and convert: $((SECONDS - start)) s" ;;
    sweep)
      model=${MODEL:-smollm2}
      dir=/tmp/$model; common=$COMMON
      if [[ $model == llama* ]]; then
        layers=${model#llama}; layers=${layers%fp8}
        if [[ ! -d $dir ]]; then
          python3 benchmarks/make_random_model.py --preset llama3-8b --tokenizer /tmp/smollm2 --out "$dir" \
            --layers "$layers" --config-only
          # The block-FP8 checkpoint format (issue 54): SGLang then builds float8 linear layers with 128 x 128 scales.
          [[ $model == *fp8 ]] && python3 -c "import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p))
c['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                            'weight_block_size': [128, 128]}
json.dump(c, open(p, 'w'), indent=1)" "$dir"
        fi
        common+="/load_format=dummy"
      fi
      # The GPU's share of the decode time, and the forward count, in SGLang's decode lines.
      export SGLANG_ENABLE_METRICS_DEVICE_TIMER=${DEVICE_TIMER:-1} SGLANG_LOG_FORWARD_ITERS=1
      for config in ${CONFIGS:?}; do
        name=${config%%:*}; sets=${config#*:}; [[ $config == *:* ]] || sets=
        left=$(( ${DEADLINE:-570} - SECONDS ))
        if (( left < 100 )); then echo "[sweep] $model $name skipped: $left s left"; continue; fi
        if [[ $name == fi* && -f /tmp/rs/fiwarm.log ]]; then
          t0=$SECONDS
          while [[ ! -f /tmp/fiwarm.rc ]] && (( ${DEADLINE:-570} - SECONDS > 160 )); do sleep 2; done
          echo "[sweep] flashinfer warm-up: waited $((SECONDS - t0)) s, exit $(cat /tmp/fiwarm.rc 2>/dev/null ||
            echo '(still compiling)')"
          left=$(( ${DEADLINE:-570} - SECONDS ))
          if (( left < 100 )); then echo "[sweep] $model $name skipped: $left s left"; continue; fi
        fi
        engine_args=(); variants=${VARIANTS:-bare-n1,adapter}; repeats=${REPEATS:-2}; profile=()
        base=/tmp/rs/${model}_$name; start=$SECONDS
        for kv in ${common//\// } ${sets//\// }; do
          case $kv in
            variants=*) variants=${kv#*=} ;; repeats=*) repeats=${kv#*=} ;;
            profile=*) profile=(--profile "${base}_trace" --profile-steps "${kv#*=}") ;;
            *) engine_args+=(--engine-arg "$kv") ;;
          esac
        done
        echo "[sweep] $model $name: ${engine_args[*]//--engine-arg /} variants $variants repeats $repeats"
        limit=$(( left - 15 < ${TCFG:-260} ? left - 15 : ${TCFG:-260} ))
        timeout -k 10 $limit python3 benchmarks/rollout_speed.py --model "$dir" --data "$DATA" \
          ${TEMPLATE:+--prompt-template "$TEMPLATE"} --prompts 64 --samples 8 --max-new-tokens 256 --engine sglang \
          "${engine_args[@]}" --variants "$variants" --repeats "$repeats" --json "$base.json" "${profile[@]}" \
          > "$base.log" 2>&1
        rc=$?
        for trace in "${base}_trace"/*DECODE*.trace.json.gz; do
          [[ -f $trace ]] && python3 benchmarks/decode_trace_summary.py "$trace" --json "$base.trace.json" |
            tee "$base.trace.txt" | head -12
        done
        python3 benchmarks/sglang_decode_log.py "$base.log" --json "$base.decode.json" > /dev/null 2>&1
        python3 - "$base" "$name" "$rc" "$((SECONDS - start))" <<'EOF'
import json, sys
base, name, rc, took = sys.argv[1:]
try:
    r = json.load(open(base + ".json"))
except (OSError, ValueError):
    print(f"[sweep] {name}: exit {rc} after {took} s, no result"); sys.exit()
d = json.load(open(base + ".decode.json"))["full_batch"]
v = r["variants"]
rates = ", ".join(f"{k} {x['tokens_per_s']} tok/s ({x['tokens']:.0f} tok)" for k, x in v.items())
ratio = v["bare-n1"]["tokens_per_s"] / v["adapter"]["tokens_per_s"] if "bare-n1" in v and "adapter" in v else 0
print(f"[sweep] {name}: exit {rc} after {took} s, start {r['start_s']} s; {rates}; bare-n1/adapter {ratio:.2f}; "
      f"full batch {d['batch']}: {d['tokens_per_s']} tok/s, step {d['step_ms']} ms, occupancy {d['occupancy_pct']}%,"
      f" graph {d['graph_share']}, kv {d['kv_tokens']}; info {r.get('engine_info')}")
EOF
        (( rc )) && grep -m3 -i "error\|Traceback" "$base.log" | cut -c1-300
        if (( rc != 0 )) && [[ ${SGLANG_ENABLE_METRICS_DEVICE_TIMER} == 1 ]] && grep -q device_timer "$base.log"; then
          echo "[sweep] the device timer failed: off from here"; export SGLANG_ENABLE_METRICS_DEVICE_TIMER=0
        fi
        tar czf "$OUT/rollout_sweep.tgz" -C /tmp rs
      done ;;
  esac
done
tar czf "$OUT/rollout_sweep.tgz" -C /tmp rs

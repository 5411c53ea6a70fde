#!/usr/bin/env bash
# SGLang's generation speed on one H200 over engine settings (issue 38, item 1): benchmarks/rollout_speed.py once
# per setting (the bare engine against megarl's adapter, on one engine), with SGLang's own decode log (batch,
# tokens/s and GPU occupancy every 40 steps) read by benchmarks/sglang_decode_log.py.
# SGLang 0.5.17 is staged as ../shared/tools/sglang-h200/README.md says (parts carried in .sglang-wheels/partN)
# and SmolLM2-135M-Instruct's GGUF (scripts/get_smollm2.sh's file) travels in five slices, .gguf/g1 .. g5:
#   bash benchmarks/h200_rollout_sweep.sh STEP...   with OUT set; steps, in order:
#     stageN   copy .sglang-wheels/partN (N <= 4) and .gguf/gN into /tmp/stage and /tmp/gguf
#     wheels   install the staged wheels into /tmp/site, in the background (after stage4); with FIWARM=1 then
#              compile flashinfer's JIT attention kernels for SmolLM2 (8 compile jobs): a setting named fi* waits
#              for that while time allows
#     convert  convert the GGUF to /tmp/smollm2, then wait for the wheels (after stage5)
#     sweep    MODEL=smollm2 (the converted model) or llama16 (Llama-3-8B's body at 16 layers, SmolLM2's tokenizer,
#              random weights: load_format=dummy); CONFIGS="name:key=value/key=value name2:..." one engine each,
#              on top of COMMON (variants=a,b and repeats=N in a setting override VARIANTS and REPEATS);
#              DATA and TEMPLATE (the GSM8K recipe's: gsm8k and its prompt template); VARIANTS (bare-n1,adapter),
#              REPEATS (2); a setting gets TCFG s at most (260);
#              DEADLINE (s since the call began, 570): a setting with less than 100 s left is skipped
# Results: /tmp/rs/MODEL_NAME.{json,log,decode.json}, packed into $OUT/rollout_sweep.tgz after each setting.
# As run (benchmarks/results/h200/rollout_speed): stage1 (carrying part1, g1); stage2 (part2, g2); stage3 (part3:
# with g3 too, 66.8 MB with the 8.9 MB tree, the call was refused as over 64 MiB); FIWARM=1 stage3 stage4 wheels
# (part4, g3, .gguf/smolcfg: SmolLM2's config and tokenizer); stage4 (g4); stage5 convert sweep (g5).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
source benchmarks/h200_common.sh
h200_session
COMMON=${COMMON:-attention_backend=triton/sampling_backend=pytorch/grammar_backend=none}
DATA=${DATA:-gsm8k}
TEMPLATE=${TEMPLATE-"{question} Let's think step by step and output the final answer after \"####\"."}
mkdir -p /tmp/stage /tmp/gguf /tmp/rs

install_wheels() {
  cd /tmp/stage && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl &&
    python3 -c "import zipfile; zipfile.ZipFile('sglang_kernel_slim.zip').extractall('/tmp/site')" &&
    rm -rf /tmp/site/soundfile* /tmp/site/_soundfile* && cp sitecustomize.py /tmp/site/
}

warm_flashinfer() {
  cd "$REPO" && MAX_JOBS=8 timeout 1500 python3 benchmarks/rollout_speed.py --model /tmp/smolcfg --data gsm8k \
    --prompts 1 --samples 2 --max-new-tokens 8 --repeats 0 --variants bare --gpu-memory-fraction 0.08 \
    --engine-arg load_format=dummy --engine-arg attention_backend=flashinfer --engine-arg sampling_backend=flashinfer \
    --engine-arg grammar_backend=none --engine-arg disable_cuda_graph=true > /tmp/rs/fiwarm.log 2>&1
  echo $? > /tmp/fiwarm.rc
}

for step in "$@"; do
  case $step in
    stage*)
      n=${step#stage}
      [[ -d .sglang-wheels/part$n ]] && cp .sglang-wheels/part"$n"/* /tmp/stage/
      [[ -f .gguf/g$n ]] && cp .gguf/g"$n" /tmp/gguf/
      echo "[sweep] staged part $n: $(ls /tmp/stage | wc -l) files, $(du -sh /tmp/gguf | cut -f1) of GGUF" ;;
    wheels)
      # In a session of its own, so that it goes on while the next call's files arrive: install the wheels, then
      # (FIWARM=1) compile flashinfer's JIT attention kernels for SmolLM2's shapes on a small engine with random
      # weights and no CUDA graphs (config and tokenizer from .gguf/smolcfg), cached for a later fi* setting.
      [[ -d .gguf/smolcfg ]] && cp -r .gguf/smolcfg /tmp/
      REPO=$PWD setsid nohup bash -c "$(declare -f install_wheels warm_flashinfer); install_wheels;
        echo \$? > /tmp/wheels.rc; [[ -n '${FIWARM:-}' ]] && warm_flashinfer" > /tmp/wheels.log 2>&1 < /dev/null &
      echo "[sweep] installing the wheels in the background${FIWARM:+, then compiling the flashinfer kernels}" ;;
    convert)
      start=$SECONDS
      { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc;
        python3 -V; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
        > /tmp/rs/env.txt
      cat /tmp/gguf/g1 /tmp/gguf/g2 /tmp/gguf/g3 /tmp/gguf/g4 /tmp/gguf/g5 > /tmp/smollm2.gguf
      echo "[sweep] gguf sha256 $(sha256sum /tmp/smollm2.gguf | cut -c1-16) (b179c9523d0e6a0f expected)"
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gg /tmp/stage/gguf-*.whl
      PYTHONPATH=/tmp/gg:$PWD python3 -m megarl.convert gguf-to-hf --gguf /tmp/smollm2.gguf --out /tmp/smollm2 \
        > /tmp/rs/convert.log 2>&1
      echo "[sweep] convert exit $?: $(tail -1 /tmp/rs/convert.log)"
      for _ in $(seq 120); do [[ -f /tmp/wheels.rc ]] && break; sleep 1; done
      echo "[sweep] wheels: exit $(cat /tmp/wheels.rc 2>/dev/null || echo 'still running'); $(tail -2 /tmp/wheels.log)"
      python3 -c "import sglang; print('[sweep] sglang', sglang.__version__)" 2>&1 | tail -1 | tee -a /tmp/rs/env.txt
      echo "[sweep] convert and install: $((SECONDS - start)) s" ;;
    sweep)
      model=${MODEL:-smollm2}
      dir=/tmp/$model; common=$COMMON
      if [[ $model == llama16 ]]; then
        [[ -d $dir ]] || python3 benchmarks/make_random_model.py --preset llama3-8b --tokenizer /tmp/smollm2 \
          --out "$dir" --layers 16 --config-only
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
        engine_args=(); variants=${VARIANTS:-bare-n1,adapter}; repeats=${REPEATS:-2}
        for kv in ${common//\// } ${sets//\// }; do
          case $kv in
            variants=*) variants=${kv#*=} ;; repeats=*) repeats=${kv#*=} ;; *) engine_args+=(--engine-arg "$kv") ;;
          esac
        done
        base=/tmp/rs/${model}_$name; start=$SECONDS
        echo "[sweep] $model $name: ${engine_args[*]//--engine-arg /} variants $variants repeats $repeats"
        limit=$(( left - 15 < ${TCFG:-260} ? left - 15 : ${TCFG:-260} ))
        timeout -k 10 $limit python3 benchmarks/rollout_speed.py --model "$dir" --data "$DATA" \
          ${TEMPLATE:+--prompt-template "$TEMPLATE"} --prompts 64 --samples 8 --max-new-tokens 256 --engine sglang \
          "${engine_args[@]}" --variants "$variants" --repeats "$repeats" --json "$base.json" > "$base.log" 2>&1
        rc=$?
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

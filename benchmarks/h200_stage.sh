#!/usr/bin/env bash
# What an H200 session needs beyond that machine's image (SGLang 0.5.17, megatron-core 0.16.1, math-verify, pytest,
# SmolLM2-135M-Instruct's GGUF, bubblewrap), staged there in as few calls as fit (benchmarks/h200/stage.sh):
#   bash benchmarks/h200_stage.sh pack           here: fetch (cached in .stage/cache), cut .stage/p1 ... pN, print
#                                                the device calls and what each carries; FA3=1 adds SGLang's
#                                                FlashAttention-3 kernels (attention_backend fa3; about 8 more parts)
#   bash benchmarks/h200_stage.sh stage N ...     on the device (OUT set): part N into /tmp/stage; N=1 also builds
#                                                the extension against the machine's torch
#   bash benchmarks/h200_stage.sh install         on the device, after the last part: into /tmp/site, and SmolLM2
#                                                converted to /tmp/smollm2
#   bash benchmarks/h200_stage.sh cache-save      on the device: compiled-kernel caches into $OUT/kernel_cache.tgz.NN
#                                                (parts of 15 MiB: larger files do not come back)
#   bash benchmarks/h200_stage.sh cache-load      on the device: restore the parts carried in .stage/kernel_cache/
# Steps chain in one call: `stage 6 install cache-load`. Later calls of a session: PYTHONPATH=/tmp/site:$PWD
# (h200_common.sh's h200_session sets it).
set -uo pipefail
source benchmarks/h200_common.sh
source benchmarks/h200/stage.sh
(( $# )) || stage_die "usage: benchmarks/h200_stage.sh pack | stage N | install | cache-save | cache-load"
[[ $1 == pack ]] || { OUT=${OUT:?set OUT to the results folder}; h200_session; }
while (( $# )); do
  case $1 in
    pack) stage_pack ;;
    stage) stage_copy "${2:-}"; shift ;;
    install) stage_install ;;
    cache-save) cache_save ;;
    cache-load) cache_load ;;
    *) stage_die "unknown step '$1': pack, stage N, install, cache-save or cache-load" ;;
  esac
  shift
done

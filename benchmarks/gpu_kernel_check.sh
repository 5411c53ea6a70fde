#!/usr/bin/env bash
# The compiled kernels on a fresh GPU machine in one call, with nothing staged: build megarl._C against the machine's
# torch, run the CUDA tests of the FP8 quantization, the segment copy and the checksum, and measure the FP8 kernel's
# rate against torch's ops (benchmarks/fp8_quant_rate.py). With OUT set (the device's result folder):
#   bash benchmarks/gpu_kernel_check.sh
# Writes $OUT/gpu_kernels/: env.txt, build.txt, pytest.txt, fp8_quant_rate.json.
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
res=$OUT/gpu_kernels
mkdir -p "$res"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "commit $(cat .git_rev 2>/dev/null || echo unknown)"; } > "$res/env.txt" 2>&1
cat "$res/env.txt"
start=$SECONDS
MAX_JOBS=16 python3 setup.py build_ext --inplace > "$res/build.txt" 2>&1
echo "[kernels] build exit $? in $((SECONDS - start)) s" | tee -a "$res/build.txt"
python3 -c "import megarl._C as c; print('[kernels] with_cuda', c.with_cuda())"
PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fp8_quant.py \
  tests/test_segment_copy.py tests/test_verify.py 2>&1 | tail -25 | tee "$res/pytest.txt"
PYTHONPATH=$PWD timeout 120 python3 benchmarks/fp8_quant_rate.py --json "$res/fp8_quant_rate.json" 2>&1 | tail -3

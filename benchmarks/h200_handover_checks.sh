#!/usr/bin/env bash
# The hand-over's own correctness on a GPU (issue 56): the CUDA tests of the copy and the checksum, the refused
# cases under compute-sanitizer, the checksum's rate, and the 8B hand-over's time with the checks against the same
# benchmark built from the code before them (BEFORE=DIR: a `git archive` of that commit's megarl, csrc, setup.py,
# pyproject.toml and benchmarks/{reshard_latency,timing}.py, carried; skipped when absent). After
# `benchmarks/h200_stage.sh stage 1` (which builds the extension), with OUT set:
#   BEFORE=.old bash benchmarks/h200_handover_checks.sh
# Writes $OUT/handover_checks/: pytest.txt, sanitizer.txt, checksum_rate_{bf16,f32}.json, reshard_8b_{after,before}.json
# (the refit alternates after / before twice, so a drift of the machine shows).
set -uo pipefail
OUT=${OUT:?set OUT to the results folder}
source benchmarks/h200_common.sh
h200_session
res=$OUT/handover_checks
mkdir -p "$res"
git_rev=$(cat .git_rev 2>/dev/null || echo unknown)
echo "[checks] commit $git_rev" | tee "$res/commit.txt"
timeout 300 python3 -m pytest -q -m gpu tests/test_verify.py tests/test_segment_copy.py tests/test_handover.py \
  2>&1 | tail -30 | tee "$res/pytest.txt"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 \
  python3 tests/cuda_refusals.py > "$res/sanitizer.txt" 2>&1
echo "[checks] compute-sanitizer exit $?" | tee -a "$res/sanitizer.txt"
tail -15 "$res/sanitizer.txt"
timeout 120 python3 benchmarks/checksum_rate.py --json "$res/checksum_rate_bf16.json" | tail -3
timeout 120 python3 benchmarks/checksum_rate.py --dtype float32 --json "$res/checksum_rate_f32.json" | tail -3
if [[ -n ${BEFORE:-} && -d $BEFORE ]]; then
  (cd "$BEFORE" && start=$SECONDS && python3 setup.py build_ext --inplace -q > build.log 2>&1 &&
     echo "[checks] the code before built in $((SECONDS - start)) s") || tail -20 "$BEFORE/build.log"
fi
for round in 1 2; do
  for side in after before; do
    dir=.
    [[ $side == before ]] && { [[ -n ${BEFORE:-} && -f $BEFORE/setup.py ]] || continue; dir=$BEFORE; }
    (cd "$dir" && PYTHONPATH=$PWD timeout 240 torchrun --standalone --nproc-per-node 1 benchmarks/reshard_latency.py \
       --model llama3-8b --iters 30 --no-baseline --json "$res/reshard_8b_${side}_$round.json" 2>&1 | tail -4)
  done
done

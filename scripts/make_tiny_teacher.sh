#!/usr/bin/env bash
# Regenerate recipes/tiny/teacher: the tiny model after 300 GRPO steps on the echo task (reward 0.02 -> 0.68 at
# temperature 1), exported to HF. tests/test_distill.py distills it into the untrained tiny model.
#   bash scripts/make_tiny_teacher.sh        (about 3 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV:-.venv}/bin/python
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$PY" megarl/train.py --config recipes/tiny_cpu_grpo.yaml --set trainer.num_steps=300 \
  --set checkpoint.save_every=300 --set "checkpoint.dir=$run" --set tracking.backend=none
rm -rf recipes/tiny/teacher.new
"$PY" -m megarl.convert mcore-to-hf --ckpt "$run/step_000299/actor" --out recipes/tiny/teacher.new
rm -rf recipes/tiny/teacher
mv recipes/tiny/teacher.new recipes/tiny/teacher

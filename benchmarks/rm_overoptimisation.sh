#!/usr/bin/env bash
# RLHF in small on the tiny echo task, CPU: the reward model of recipes/tiny_cpu_rm.yaml, exported, then KL-PPO from
# the base model (recipes/tiny_cpu_rlhf.yaml) three ways from the same start and seeds:
#   rm      against the reward model alone (reward_model.rule_weight 0), the recipe's kl_coef 0.3;
#   rm_lowkl the same at kl_coef 0.01, the rule recipe's: the reward model over-optimised;
#   rule    against the task's rule reward (no reward model) at kl_coef 0.01, the rule recipe's
#           (recipes/tiny_cpu_ppo.yaml): a 0/1 reward under a KL of 0.3 a token barely moves.
# Each logs the rule on the held-out prompts (sampled as in training) every 10 steps, and the reward model's runs log
# its score beside the rule on the training batch. Writes OUT/{rm_training,rm,rm_lowkl,rule}/metrics.jsonl, samples
# of the rm runs, and OUT/table.md.
#   OUT=benchmarks/results/cpu/rm_overoptimisation bash benchmarks/rm_overoptimisation.sh
set -euo pipefail
OUT=${OUT:?set OUT to the results folder}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"
git rev-parse --short HEAD > "$OUT/commit.txt"
echo "== reward model (recipes/tiny_cpu_rm.yaml)"
torchrun --standalone --nproc-per-node 1 -m megarl.train_rm --config recipes/tiny_cpu_rm.yaml \
  --set checkpoint.dir="$work/rm_training" 2>&1 | grep "held-out" | tail -2
python -m megarl.convert mcore-to-hf --ckpt "$work/rm_training/$(cat "$work/rm_training/latest")/reward_model" \
  --out "$work/rm_hf"
ppo() {  # NAME OVERRIDES...
  local name=$1
  shift
  echo "== $name"
  torchrun --standalone --nproc-per-node 1 megarl/train.py --config recipes/tiny_cpu_rlhf.yaml \
    --set checkpoint.dir="$work/$name" --set trainer.log_samples=20 "$@" 2>&1 | grep -E "^step (1|20|40|60)/" |
    cut -c1-70
}
ppo rm --set reward_model.path="$work/rm_hf"
ppo rm_lowkl --set reward_model.path="$work/rm_hf" --set algorithm.kl_coef=0.01
ppo rule --set reward_model.path=null --set algorithm.kl_coef=0.01
for name in rm_training rm rm_lowkl rule; do
  mkdir -p "$OUT/$name"
  cp "$work/$name/metrics.jsonl" "$OUT/$name/"
done
for name in rm rm_lowkl; do
  mkdir -p "$OUT/$name/samples"
  cp "$work/$name/samples/step_0.jsonl" "$work/$name/samples/step_40.jsonl" "$OUT/$name/samples/"
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {name: [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("rm", "rm_lowkl", "rule")}


def held_out(rows, step):
    key = "eval/echo/initial/mean@4" if step < 0 else "eval/echo/mean@4"
    return next(r[key] for r in rows if key in r and (step < 0 or r["step"] == step))


rm_rows = [json.loads(line) for line in (out / "rm_training" / "metrics.jsonl").read_text().splitlines()]
lines = [f"Reward model: held-out pairwise accuracy {rm_rows[0]['eval/initial/accuracy']:.3f} -> "
         f"{rm_rows[-1]['eval/accuracy']:.3f} in {len(rm_rows)} steps.", "",
         "| step | held-out rule: PPO vs RM (kl 0.3) | vs RM (kl 0.01) | vs rule (kl 0.01) | RM score (kl 0.3) | "
         "rule on its batch (kl 0.3) | KL (kl 0.3) | RM score (kl 0.01) | rule on its batch (kl 0.01) | KL (kl 0.01) |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for step in [-1, 9, 19, 29, 39, 49, 59]:
    cells = [f"{held_out(runs[n], step):.3f}" for n in ("rm", "rm_lowkl", "rule")]
    for n in ("rm", "rm_lowkl"):
        if step < 0:
            cells += ["-", "-", "-"]
            continue
        window = [r for r in runs[n] if step - 9 <= r["step"] <= step]  # the ten steps up to the evaluation
        mean = lambda key: sum(r.get(key, 0.0) for r in window) / len(window)  # noqa: E731
        cells += [f"{mean('reward_model/score_mean'):.2f}", f"{mean('reward_model/rule_mean'):.3f}",
                  f"{mean('kl'):.2f}"]
    lines.append(f"| {'before' if step < 0 else step + 1} | " + " | ".join(cells) + " |")
(out / "table.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

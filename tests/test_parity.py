"""megarl's Megatron models equal HF transformers across TP/PP/VPP(/EP) layouts (float32, CPU, gloo)."""


import pytest

from helpers import make_hf_model, run_worker

# float32 on CPU: the observed worst case is ~1e-6 (summation order differs across TP shards).
MAX_ABS_DIFF = 1e-4


@pytest.mark.slow
def test_logits_logprobs_values_match_transformers(tmp_path):
    llama = make_hf_model(tmp_path / "llama", "llama")
    qwen2 = make_hf_model(tmp_path / "qwen2", "qwen2", max_shard_size="100KB")  # sharded, with an index
    qwen3 = make_hf_model(tmp_path / "qwen3", "qwen3")  # QK-norm, head_dim 32 with hidden 64
    qwen3_moe = make_hf_model(tmp_path / "qwen3_moe", "qwen3_moe")  # 8 experts, top-2, in every layer
    results = run_worker("parity.py", tmp_path, llama, qwen2, qwen3, qwen3_moe)
    seen = {(r["model"], r["tp"], r["pp"], r["vpp"], r["ep"]) for r in results}
    layouts = {(1, 1, None, 1), (2, 1, None, 1), (1, 2, None, 1), (2, 2, None, 1), (1, 2, 2, 1)}
    # Experts split over 2 or 4 expert-parallel ranks, with TP or PP beside them.
    moe_layouts = {(1, 1, None, 2), (1, 1, None, 4), (2, 1, None, 2), (1, 2, None, 2)}
    assert seen == ({(m, *layout) for m in ("llama", "qwen2", "qwen3", "qwen3_moe") for layout in layouts}
                    | {("qwen3_moe", *layout) for layout in moe_layouts})
    assert all("SequentialMLP" in r["layers"] for r in results if r["model"] == "qwen3_moe")
    for row in results:
        for key in ("logits", "logprobs", "chunked_logprobs", "values"):
            assert row[key] < MAX_ABS_DIFF, row


def test_a_fractional_rope_theta_is_used_whole(tmp_path):
    """rope_theta 10.5 is not 10 (megatron-core's rotary_base is typed int, and megarl once passed int(rope_theta));
    10.5, not a real model's 10000.5: the fraction of that moves these logits by 6e-7, under float32's noise."""
    # Qwen2's plain RoPE: with llama3 scaling megarl computes the frequencies itself
    qwen2 = make_hf_model(tmp_path / "qwen2", "qwen2", rope_theta=10.5)
    [row] = run_worker("parity.py", tmp_path, qwen2, nproc=1)
    assert (row["tp"], row["pp"]) == (1, 1)
    for key in ("logits", "logprobs", "chunked_logprobs", "values"):
        assert row[key] < MAX_ABS_DIFF, row

"""megarl's Megatron models equal HF transformers across TP/PP/VPP layouts (float32, CPU, gloo)."""


import pytest

from helpers import make_hf_model, run_worker

# float32 on CPU: the observed worst case is ~1e-6 (summation order differs across TP shards).
MAX_ABS_DIFF = 1e-4


@pytest.mark.slow
def test_logits_logprobs_values_match_transformers(tmp_path):
    llama = make_hf_model(tmp_path / "llama", "llama")
    qwen2 = make_hf_model(tmp_path / "qwen2", "qwen2", max_shard_size="100KB")  # sharded, with an index
    qwen3 = make_hf_model(tmp_path / "qwen3", "qwen3")  # QK-norm, head_dim 32 with hidden 64
    results = run_worker("parity.py", tmp_path, llama, qwen2, qwen3)
    seen = {(r["model"], r["tp"], r["pp"], r["vpp"]) for r in results}
    layouts = {(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)}
    assert seen == {(m, *layout) for m in ("llama", "qwen2", "qwen3") for layout in layouts}
    for row in results:
        for key in ("logits", "logprobs", "values"):
            assert row[key] < MAX_ABS_DIFF, row

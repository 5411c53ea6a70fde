"""LoRA adapters under tensor parallelism (with and without sequence parallelism) and pipeline parallelism give
TP1's loss and adapter gradients, and the merged-weight model's loss (tests/workers/lora.py, one launch)."""

import pytest

from helpers import make_hf_model, run_worker


@pytest.mark.slow
def test_adapters_give_the_same_loss_and_gradients_in_every_layout(tmp_path):
    llama = make_hf_model(tmp_path / "llama", "llama")
    qwen2 = make_hf_model(tmp_path / "qwen2", "qwen2")
    rows = run_worker("lora.py", tmp_path, llama, qwen2, nproc=2)
    assert {(r["model"], r["tp"], r["pp"], r["sp"]) for r in rows} == {
        ("llama", 1, 1, False), ("llama", 2, 1, False), ("llama", 2, 1, True), ("llama", 1, 2, False),
        ("qwen2", 1, 1, False), ("qwen2", 2, 1, True)}
    for row in rows:
        where = (row["model"], row["tp"], row["pp"], row["sp"])
        assert row["replica_spread"] == 0.0, where  # the replicated factor's gradient is the same on every TP rank
        if row["tp"] == row["pp"] == 1:
            assert row["grad_max"] > 1e-3, where  # the gradients compared below are not all zero
            assert abs(row["loss"] - row["merged"]) < 1e-6, where
            continue
        assert row["grad_diff"] < 1e-6, where
        if "loss_diff" in row:  # the last pipeline stage
            assert row["loss_diff"] < 1e-6 and row["merged_diff"] < 1e-6, where
    pp_layers = [r["layers"] for r in rows if r["pp"] == 2]
    assert sorted(pp_layers) == [["1", "2"], ["3", "4"]]  # each stage compared its own layers

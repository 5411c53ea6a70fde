"""A GRPO actor update gives the same loss, grad norm and new weights in every TP/PP/DP layout."""


import pytest

from helpers import make_hf_model, run_worker


@pytest.mark.slow
def test_actor_update_is_layout_invariant(tmp_path):
    model = make_hf_model(tmp_path / "llama", "llama")
    rows = {(r["tp"], r["pp"]): r for r in run_worker("trainable.py", tmp_path, model)}
    assert set(rows) == {(1, 1), (2, 1), (1, 2), (2, 2)}
    ref = rows[1, 1]  # 4 data-parallel replicas
    assert 0 < ref["clip_fraction"] < 1 and ref["grad_norm"] > 0, ref
    for layout, row in rows.items():
        assert abs(row["loss"] - ref["loss"]) < 1e-5, layout
        assert abs(row["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"], layout
        diff = max(abs(a - b) for a, b in zip(row["logprobs_after"], ref["logprobs_after"], strict=True))
        assert diff < 1e-4, (layout, diff)

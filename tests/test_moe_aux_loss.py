"""model.moe_aux_loss_coeff: the router's load-balancing loss counts real tokens only. It counted the padding of
fixed-size micro-batches too, so its gradient moved with micro_batch_size, packing and the empty micro-batches
expert parallelism adds (32% here), whatever the real tokens were."""

import pytest

from helpers import make_hf_model, run_worker


@pytest.mark.slow
def test_padding_rows_leave_the_load_balancing_gradient_unchanged(tmp_path):
    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    [row] = run_worker("moe_aux_padding.py", tmp_path, model, nproc=4)
    assert row["2"]["padding"] == 0 and row["4"]["padding"] == 0.5
    assert row["2"]["grad_norm"] > 0  # the aux loss alone gives the gradient
    assert row["4"]["grad_norm"] == pytest.approx(row["2"]["grad_norm"], rel=1e-5)

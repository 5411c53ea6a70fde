"""One actor on two CPU ranks (tests/workers/actor_checks.py, one launch): an optimizer step does not depend on
how data parallelism splits its mini-batch, logprobs are those of the sampling temperature, a resumed run
continues the LR schedule (cosine with warm-up) exactly, and the exported HF model computes what the trainer's
actor computes."""

import pytest

from helpers import make_hf_model, run_worker


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("actor")
    model = make_hf_model(tmp / "llama", "llama", num_hidden_layers=2)
    [out] = run_worker("actor_checks.py", tmp, model, nproc=2)
    return out


def test_a_step_is_the_same_under_dp2_and_dp1(rows):
    """Token weights are normalised over the mini-batch, not per DP rank: DP2's loss and grad norm equal those
    of the same mini-batch on one replica (TP2), although one rank holds 3x the other's tokens."""
    dp2, dp1 = rows["dp"]["dp2"], rows["dp"]["dp1"]
    assert dp1["grad_norm"] > 0
    for key in ("loss", "policy_loss", "kl_loss", "entropy"):
        assert dp2[key] == pytest.approx(dp1[key], abs=1e-5), (key, dp2[key], dp1[key])
    assert dp2["grad_norm"] == pytest.approx(dp1["grad_norm"], rel=1e-4)
    assert dp2["clip_fraction"] == dp1["clip_fraction"] and 0 < dp1["clip_fraction"] < 1
    # The entropy term is that of the sampling temperature (transformers' logits / T, float64).
    assert dp1["entropy"] == pytest.approx(rows["dp"]["hf_entropy"], abs=1e-5)


def test_logprobs_are_those_of_the_sampling_temperature(rows):
    t = rows["temperature"]
    assert t["diff"] < 1e-5, t
    assert t["diff_at_1"] > 0.1, t  # T = 0.7 is far from T = 1: the check above can tell them apart


def test_resume_continues_the_lr_schedule_and_the_run(rows):
    full, resumed = rows["resume"]["full"], rows["resume"]["resumed"]
    lrs = [r["lr"] for r in full]
    # Warm-up then cosine decay: the schedule moves at every step, so a restarted one cannot match by chance.
    assert len(set(lrs)) == len(lrs), lrs
    for step, (a, b) in enumerate(zip(full[-len(resumed):], resumed, strict=True)):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9, abs=0), (step, lrs, [r["lr"] for r in resumed])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), step


def test_exported_actor_computes_the_trainers_logprobs(rows):
    moved, diff = rows["resume"]["trained_moved"], rows["resume"]["export_diff"]
    assert moved > 1e-2, moved  # training moved the logprobs: an export of the starting weights would show
    assert diff < 1e-5, f"the exported model's logprobs differ from the trainer's by up to {diff}"

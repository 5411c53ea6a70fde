"""A GRPO actor update (with an entropy bonus, at a sampling temperature) gives the same loss, entropy,
grad norm and new weights in every TP/PP/DP layout,
with sequences packed into shared rows, each padded in a row of its own, or in fixed micro-batches,
and with sequence parallelism; packed rows also in Megatron's THD format."""


import pytest

from helpers import make_hf_model, run_worker


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def hf_logprobs(model_dir, sequences: list[list[int]], temperature: float) -> list[float]:
    """transformers' log-probabilities of every next token of every sequence, at ``temperature``, end to end."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    out: list[float] = []
    with torch.no_grad():
        for seq in sequences:
            logits = model(torch.tensor([seq])).logits[0, :-1].double() / temperature
            out += logits.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
    return out


@pytest.mark.slow
def test_actor_update_is_layout_and_packing_invariant(tmp_path):
    model = make_hf_model(tmp_path / "llama", "llama")
    # A distillation teacher: another architecture, twice as wide, with the student's vocabulary.
    teacher = make_hf_model(tmp_path / "teacher", "qwen2", seed=3, vocab_size=200, hidden_size=128,
                            intermediate_size=256, num_attention_heads=8, num_key_value_heads=4)
    everything = run_worker("trainable.py", tmp_path, model, teacher)
    taught = {(r["tp"], r["pp"]): r for r in everything if r["mode"] == "teacher"}
    assert set(taught) == {(1, 1), (2, 1), (1, 2), (2, 2)}
    expected = hf_logprobs(teacher, taught[1, 1]["sequences"], temperature=0.8)
    for layout, row in taught.items():  # transformers in float64 from float32 weights: the same in every layout
        assert max_diff(row["logprobs"], expected) < 1e-5, layout
    everything = [r for r in everything if r["mode"] != "teacher"]
    # A NaN in the loss stops every rank before the optimizer step touches the weights.
    stopped = [r for r in everything if r["mode"] == "nan"]
    assert len(stopped) == 4 and all("step 5, actor" in r["error"] and "loss = nan" in r["error"] for r in stopped)
    assert all(r["weights_finite"] for r in stopped)
    rows = {(r["tp"], r["pp"], r["mode"]): r for r in everything if r["mode"] != "nan"}
    layouts = {(1, 1), (2, 1), (1, 2), (2, 2)}
    assert set(rows) == ({(*layout, mode) for layout in layouts for mode in ("packed", "unpacked", "fixed")}
                         | {(*layout, "thd") for layout in layouts}
                         | {(2, 1, "sp"), (2, 2, "sp"), (2, 2, "thd_sp"), (2, 1, "bfloat16"), (2, 1, "float16"),
                            (2, 1, "twice"), (2, 1, "offload"), (1, 2, "vpp")})
    # Weights, gradient buffers and optimizer state (Adam moments, master weights) offloaded to host
    # memory between two steps and brought back: the second step is bit for bit the one without.
    offloaded, kept = rows.pop((2, 1, "offload")), rows.pop((2, 1, "twice"))
    assert offloaded["logprobs_after"] == kept["logprobs_after"] and offloaded["loss"] == kept["loss"]
    assert kept["logprobs_after"] != rows[2, 1, "packed"]["logprobs_after"]  # the second step did move
    # One float16 step moves the logprobs as much as a bfloat16 step (the loss is scaled before backward).
    half, brain = rows.pop((2, 1, "float16")), rows.pop((2, 1, "bfloat16"))
    moved = {name: sum(abs(a - b) for a, b in zip(r["logprobs_after"], r["logprobs_before"], strict=True))
             for name, r in (("float16", half), ("bfloat16", brain))}
    assert half["update_skipped"] == 0 and 0.7 < moved["float16"] / moved["bfloat16"] < 1.4, (moved, half)
    ref = rows[1, 1, "packed"]  # 4 data-parallel replicas
    assert 0 < ref["clip_fraction"] < 1 and ref["grad_norm"] > 0, ref
    for key, row in rows.items():
        assert abs(row["loss"] - ref["loss"]) < 1e-5, key
        assert abs(row["entropy"] - ref["entropy"]) < 1e-5, key
        assert abs(row["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"], key
        assert max_diff(row["logprobs_after"], ref["logprobs_after"]) < 1e-4, key
    for tp, pp in layouts:
        packed, unpacked = rows[tp, pp, "packed"], rows[tp, pp, "unpacked"]
        # Packed rows differ from unpacked ones only in float rounding (RoPE angles, summation order).
        # Measured: logprobs 1e-6, loss 3e-8, grad norm 2e-7 relative; after one Adam step at lr 1e-2,
        # which magnifies rounding as much as a TP/PP layout change does (3e-5), logprobs 1.2e-5.
        assert max_diff(packed["logprobs_before"], unpacked["logprobs_before"]) < 1e-5, (tp, pp)
        assert abs(packed["loss"] - unpacked["loss"]) < 1e-6, (tp, pp)
        assert abs(packed["grad_norm"] - unpacked["grad_norm"]) < 1e-5 * unpacked["grad_norm"], (tp, pp)
        assert max_diff(packed["logprobs_after"], unpacked["logprobs_after"]) < 5e-5, (tp, pp)
        assert packed["padding_fraction"] <= unpacked["padding_fraction"], (tp, pp)
        # The same rows end to end (THD): RoPE restarts at each sequence instead of rotating by its offset.
        thd = rows[tp, pp, "thd"]
        assert max_diff(thd["logprobs_before"], unpacked["logprobs_before"]) < 1e-5, (tp, pp)
        assert abs(thd["loss"] - unpacked["loss"]) < 1e-6, (tp, pp)
        assert abs(thd["grad_norm"] - unpacked["grad_norm"]) < 1e-5 * unpacked["grad_norm"], (tp, pp)
        assert max_diff(thd["logprobs_after"], unpacked["logprobs_after"]) < 5e-5, (tp, pp)
        assert thd["padding_fraction"] == packed["padding_fraction"], (tp, pp)
    # Every rank has all 8 sequences at DP 1: packing fills the rows that padding wasted.
    assert rows[2, 2, "packed"]["padding_fraction"] < rows[2, 2, "unpacked"]["padding_fraction"] - 0.2
    # Fixed micro-batches (dynamic_batch: false) pad every sequence to the longest, as PP needs anyway.
    assert rows[2, 2, "fixed"]["padding_fraction"] == rows[2, 2, "unpacked"]["padding_fraction"]

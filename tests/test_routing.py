"""Routing replay (algorithm.routing_replay): the actor's MoE routers take the experts the engine chose."""

import base64

import numpy as np
import pytest
import torch

from helpers import make_hf_model, run_worker
from megarl.config import build_config
from megarl.config.yaml_io import FieldError
from megarl.data.batching import Layout, build_micro_batches
from megarl.loop.rl_step import Batch
from megarl.models.routing import LayerReplay, place_routing, routing_dtype
from megarl.rollout.sglang import decode_routed_experts

MAX_ABS_DIFF = 1e-4  # float32 on CPU, as test_parity.py


@pytest.mark.slow
def test_replayed_routing_gives_transformers_logprobs_with_the_same_experts_in_every_layout(tmp_path):
    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    results = run_worker("routing.py", tmp_path, model)
    scored = [r for r in results if r["kind"] == "score"]
    # "thd": the rows end to end in Megatron's packed format (Transformer Engine's), the router's tokens in that order.
    assert {(r["tp"], r["pp"], r["vpp"], r["ep"], r["packing"]) for r in scored} == {
        *((*layout, "auto") for layout in ((1, 1, None, 1), (2, 1, None, 1), (1, 2, None, 1), (1, 2, 2, 1),
                                           (1, 1, None, 2), (2, 1, None, 2))), (2, 1, None, 2, "thd")}
    for row in scored:
        # Random experts change the result far beyond float noise, so matching them is not luck.
        assert row["forced_vs_own"] > 0.1, row
        assert row["forced"] < MAX_ABS_DIFF and row["own"] < MAX_ABS_DIFF, row
        # Random choices of 2 of 8 experts are rarely the router's own; replaying its own never disagrees.
        assert row["forced_disagreement"] > 0.8 and row["own_disagreement"] == 0.0, row
    trained = [r for r in results if r["kind"] == "train"]
    assert {(r["tp"], r["pp"], r["ep"], r["recompute"], r["packing"]) for r in trained} == {
        (1, 1, 1, False, "auto"), (1, 2, 1, True, "auto"), (2, 1, 1, True, "auto"), (1, 1, 2, False, "auto"),
        (1, 2, 1, True, "thd")}
    base = next(r for r in trained if (r["tp"], r["pp"], r["ep"]) == (1, 1, 1))
    for row in trained:
        assert abs(row["loss"] - base["loss"]) < 1e-5, row
        assert abs(row["grad_norm"] - base["grad_norm"]) < 1e-4 * base["grad_norm"], row
        assert np.abs(np.array(row["logprobs_after"]) - np.array(base["logprobs_after"])).max() < 1e-4, row


def test_routing_is_placed_where_each_sequence_sits_in_packed_rows():
    sequences = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    (batch,) = build_micro_batches(sequences, Layout([[[0, 2], [1]]], [6], [2]))
    routing = [np.arange(len(s) - 1, dtype=np.uint8).reshape(-1, 1, 1) * 10 + i for i, s in enumerate(sequences)]
    placed = place_routing(batch, routing, num_layers=1, topk=1)[..., 0, 0]
    # Row 0: sequence 0 (4 tokens), then sequence 2 (2 tokens); row 1: sequence 1 and padding. Each sequence's
    # last token and the padding are -1: the router chooses for them itself.
    assert placed.tolist() == [[0, 10, 20, -1, 2, -1], [1, 11, -1, -1, -1, -1]]


def test_a_replay_routes_unreplayed_tokens_itself_and_recompute_takes_routing_in_micro_batch_order():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.2, 0.3]])

    def topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k=k, dim=1)

    replay = LayerReplay(recompute=True)
    first, second = torch.tensor([[0], [-1]]), torch.tensor([[2], [1]])
    replay.push(first, counting=True)
    with torch.no_grad():
        probs, index = replay.get_replay_topk(scores, 1, None, None, topk)
    assert index.tolist() == [[0], [0]] and probs.tolist() == [[pytest.approx(0.1)], [pytest.approx(0.8)]]
    assert replay.counts.tolist() == [1, 1]  # token 0 replayed, and the router would pick expert 1 for it
    replay.push(second, counting=False)
    with torch.no_grad():
        assert replay.get_replay_topk(scores, 1, None, None, topk)[1].tolist() == [[2], [1]]
    # The backward pass recomputes micro-batch 1, then 2, with grad enabled: from the queue, not the latest.
    assert replay.get_replay_topk(scores, 1, None, None, topk)[1].tolist() == [[0], [0]]
    assert replay.get_replay_topk(scores, 1, None, None, topk)[1].tolist() == [[2], [1]]
    assert replay.counts.tolist() == [1, 1]
    replay.clear()
    assert replay.get_replay_topk(scores, 1, None, None, topk)[1].tolist() == [[1], [0]]


def test_sglang_routed_experts_decode_and_a_broken_reply_is_refused():
    experts = np.array([[[3, 1], [0, 2]], [[1, 0], [2, 3]], [[0, 3], [1, 2]]], dtype=np.int32)  # [3 tokens, 2, 2]
    encoded = base64.b64encode(experts.tobytes()).decode()
    decoded = decode_routed_experts(encoded, num_tokens=3, num_layers=2, topk=2, num_experts=4)
    assert decoded.dtype == routing_dtype(4) == np.uint8 and (decoded == experts).all()
    with pytest.raises(RuntimeError, match="12 routed expert ids for 4 tokens"):
        decode_routed_experts(encoded, num_tokens=4, num_layers=2, topk=2, num_experts=4)
    with pytest.raises(RuntimeError, match=r"expert ids in \[0, 3\] for a model of 3 experts"):
        decode_routed_experts(encoded, num_tokens=3, num_layers=2, topk=2, num_experts=3)
    with pytest.raises(RuntimeError, match="no routed experts"):
        decode_routed_experts(None, num_tokens=3, num_layers=2, topk=2, num_experts=4)
    assert routing_dtype(256) == np.uint8 and routing_dtype(257) == np.int16


def test_batches_keep_each_samples_routing_when_selected_and_concatenated():
    routing = [np.full((n - 1, 1, 2), i, dtype=np.uint8) for i, n in enumerate((4, 3, 5))]
    batch = Batch.build([[1], [2], [3]], [[4, 5, 6], [7, 8], [9, 1, 2, 3]], [[0.0] * 3, [0.0] * 2, [0.0] * 4],
                        [1.0, 0.0, 1.0], routing)
    picked = Batch.concat([batch.select([2, 0]), batch.select([1])])
    assert picked.routing is not None
    assert [int(r[0, 0, 0]) for r in picked.routing] == [2, 0, 1]
    assert [r.shape[0] for r in picked.routing] == [len(s) - 1 for s in picked.sequences]


def test_routing_replay_needs_an_engine_that_returns_its_routing():
    data = {"model": {"hf_path": "m"}, "data": {"train_path": "p.jsonl"}}
    with pytest.raises(FieldError, match="algorithm.routing_replay.*only SGLang"):
        build_config(data, ["algorithm.routing_replay=true", "rollout.engine=vllm"])
    assert build_config(data, ["algorithm.routing_replay=true", "rollout.engine=sglang"]).algorithm.routing_replay


def test_the_sglang_adapter_asks_for_routed_experts_and_hands_them_back_per_sample(tmp_path, fake_sglang):
    from megarl.models.spec import load_spec
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.sglang import SGLangEngine

    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    spec = load_spec(model)
    calls = fake_sglang("custom_sigquit_handler", "enable_return_routed_experts")
    calls["shape"] = (spec.num_layers, spec.num_experts_per_tok)
    engine = SGLangEngine(str(model), return_routed_experts=True)
    assert calls["start"]["enable_return_routed_experts"] is True
    done = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=2))
    assert calls["generate"] == {"return_routed_experts": True}
    assert [c.routed_experts.shape for c in done] == [(4, spec.num_layers, spec.num_experts_per_tok)] * 2
    assert [int(c.routed_experts.max()) for c in done] == [0, 1]  # each sample its own routing

    plain = SGLangEngine(str(model))  # without replay nothing is asked for, and nothing is returned
    assert "enable_return_routed_experts" not in calls["start"]
    assert plain.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].routed_experts is None
    assert calls["generate"] == {}


def test_an_sglang_that_cannot_return_routed_experts_is_refused_for_routing_replay(tmp_path, fake_sglang):
    from megarl.errors import UserError
    from megarl.rollout.sglang import SGLangEngine

    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    fake_sglang("custom_sigquit_handler")
    with pytest.raises(UserError, match="routing_replay needs an SGLang that returns routed experts.*0.0.test"):
        SGLangEngine(str(model), return_routed_experts=True)

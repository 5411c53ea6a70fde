"""How the SGLang adapter's generate_until drives the engine (async_rl.chunk_tokens: null), on a scripted SGLang
(conftest's fake_sglang: one token per request per engine step). The real engine's abort is checked on a GPU
(tests/test_rollout_sglang_gpu.py)."""

from __future__ import annotations

import asyncio

import pytest

from helpers import make_hf_model
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang import SGLangEngine

PROMPTS = [[3, 17, 42], [100, 5, 9, 77], [64, 64, 1]]


@pytest.fixture
def engine(tmp_path, fake_sglang):
    calls = fake_sglang("custom_sigquit_handler")
    eng = SGLangEngine(str(make_hf_model(tmp_path / "m", "llama")))
    yield eng, calls
    eng.engine.loop.close()


def test_the_rest_is_aborted_once_enough_is_done_and_comes_back_with_its_tokens(engine):
    eng, calls = engine
    asked: list[list[int]] = []

    def enough(done):
        asked.append(list(done))
        return len(done) >= 1

    cut = eng.generate_until(PROMPTS, SamplingParams(temperature=1.0, budgets=[12, 3, 12]), enough)
    assert asked == [[1]]  # asked once something finished, with what had
    assert [c.finish_reason for c in cut] == ["abort", "length", "abort"]
    assert all(3 <= len(cut[i].token_ids) < 12 for i in (0, 2))  # cut, after the steps the abort took to arrive
    assert all(c.logprobs == [-0.5] * len(c.token_ids) for c in cut)
    assert eng.engine.tokenizer_manager.rid_to_state == {}
    assert len(calls["aborted"]) == 2 and len({len(rid) for rid in calls["aborted"]}) == 1  # ids of one length


def test_with_nothing_to_stop_it_every_request_runs_to_its_budget(engine):
    eng, calls = engine
    done = eng.generate_until(PROMPTS, SamplingParams(temperature=1.0, budgets=[2, 5, 1]), lambda done: False)
    assert [len(c.token_ids) for c in done] == [2, 5, 1] and {c.finish_reason for c in done} == {"length"}
    assert calls["aborted"] == []
    with pytest.raises(ValueError, match="once per prompt"):
        eng.generate_until(PROMPTS, SamplingParams(n=2, max_new_tokens=4), lambda done: False)


def test_a_call_that_fails_leaves_nothing_running_in_the_engine(engine):
    eng, calls = engine

    def enough(done):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate_until(PROMPTS, SamplingParams(temperature=1.0, budgets=[9, 1, 9]), enough)
    assert sorted(calls["aborted"]) == sorted(eng.engine.tokenizer_manager.rid_to_state)
    assert len(calls["aborted"]) == 2
    eng.engine.loop.run_until_complete(asyncio.sleep(0.01))  # the engine's next call runs their aborts out
    assert eng.engine.tokenizer_manager.rid_to_state == {}

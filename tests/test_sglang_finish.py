"""The SGLang adapter's finish reasons and KV cache flushes, on conftest's scripted SGLang: SGLang checks an abort,
then the budget, then the stop tokens, so a sample whose last token is EOS comes back "length" or "abort"; the
adapter reports it complete. The model's EOS ids (config.json, generation_config.json: an int or a list) count as
the requested stop ids do."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from helpers import make_hf_model
from megarl.rollout.base import SamplingParams
from megarl.rollout.sglang import SGLangEngine
from megarl.rollout.stops import model_eos_ids, sample_stop_ids

EOS = 7


@pytest.fixture
def engine(tmp_path, fake_sglang):
    """An adapter over a model whose generation_config.json lists EOS (config.json has the family's own)."""
    fake_sglang("custom_sigquit_handler")
    model = make_hf_model(tmp_path / "m", "llama")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 128]}))
    eng = SGLangEngine(str(model))
    yield eng
    eng.engine.loop.close()


def scripted(tokens: list[int], finish: str) -> dict:
    return {"output_ids": tokens, "meta_info": {"finish_reason": {"type": finish},
                                                "output_token_logprobs": [(-0.5, t, None) for t in tokens]}}


def test_the_models_eos_ids_are_read_as_an_int_or_a_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_eos_ids(tmp_path) == (7,)  # no generation config: the model config's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9, None]}))
    # SGLang stops at both files' ids (vLLM at the generation config's alone, and is asked for the rest)
    assert model_eos_ids(tmp_path) == (2, 9, 7)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [9, 2]}))
    assert model_eos_ids(tmp_path) == (2, 9)
    assert model_eos_ids(tmp_path / "missing") == ()


def test_training_and_evaluation_stop_at_the_same_ids(tmp_path):
    """In-training evaluation (and megarl.evaluate) stopped at the tokenizer's EOS alone, while training's samples
    ended at config.json's too: on vLLM an evaluation ran past a token where a training sample ends."""
    import types

    from megarl.loop.bootstrap import stop_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    tokenizer = types.SimpleNamespace(eos_token_id=2)
    assert stop_ids(tokenizer, str(tmp_path)) == sample_stop_ids(2, tmp_path) == (2, 7)
    assert sample_stop_ids(None, tmp_path) == (7,) and sample_stop_ids(7, tmp_path) == (7,)


def test_a_budget_that_ends_on_eos_is_a_stop_and_one_that_ends_elsewhere_is_a_cut(engine):
    """max_new_tokens reached exactly at EOS: SGLang says "length", the sample is complete."""
    engine.engine.generate = lambda input_ids, sampling_params, return_logprob, **kw: [
        scripted([5, EOS], "length"), scripted([5, 6], "length"), scripted([5, 40], "length")]
    done = engine.generate([[3], [4], [8]], SamplingParams(max_new_tokens=2, stop_token_ids=[40]))
    assert [c.finish_reason for c in done] == ["stop", "length", "stop"]


def test_a_budget_that_ends_on_the_model_configs_own_eos_is_a_stop(engine, tmp_path):
    """SGLang stops at config.json's EOS too when generation_config.json lists others: a chunk that ends on it
    comes back "length" and must not be resumed past it."""
    config_eos = json.loads((tmp_path / "m" / "config.json").read_text())["eos_token_id"]
    assert config_eos not in (EOS, 128)
    engine.engine.generate = lambda input_ids, sampling_params, return_logprob, **kw: [
        scripted([5, config_eos], "length")]
    assert engine.generate([[3]], SamplingParams(max_new_tokens=2))[0].finish_reason == "stop"


def test_an_aborted_request_that_kept_an_eos_is_a_stop(engine):
    outputs = {0: scripted([EOS], "stop"), 1: scripted([5, EOS], "abort"), 2: scripted([5, 6], "abort")}

    async def async_generate(input_ids, sampling_params, return_logprob, rid, **kw):
        await asyncio.sleep(0.01 * input_ids[0])
        return outputs[input_ids[0]]

    engine.engine.async_generate = async_generate
    cut = engine.generate_until([[0], [1], [2]], SamplingParams(max_new_tokens=4), lambda done: len(done) >= 1)
    assert [c.finish_reason for c in cut] == ["stop", "stop", "abort"]


def test_a_kv_cache_is_flushed_when_it_wakes(engine):
    """A build with enable_kv_cache_cpu_backup restores the cache (and its prefix tree) of the weights before the
    hand-over when it wakes: a hand-over made while the cache slept must not leave those prefixes to be read."""
    calls: list[str] = []
    engine.engine.release_memory_occupation = lambda: calls.append("release")
    engine.engine.resume_memory_occupation = lambda tags: calls.append(f"resume {tags}")
    engine.engine.flush_cache = lambda: calls.append("flush") or types.SimpleNamespace(success=True)
    engine.sleep()
    engine.wake("weights")
    engine.wake("cache")
    assert calls == ["release", "resume ['weights']", "resume ['kv_cache', 'cuda_graph']", "flush"]
    engine.engine.flush_cache = lambda: types.SimpleNamespace(success=False)
    with pytest.raises(RuntimeError, match="did not flush its KV cache"):
        engine.wake("all")


def test_a_sample_sglang_ended_for_nan_probabilities_stops_the_step(engine):
    """SGLang writes a stop token over a token it sampled outside the vocabulary and reports a "stop": trained as
    a clean stop, with the logprob of a token never sampled, unless the adapter refuses it."""
    out = scripted([5, EOS], "stop")
    out["meta_info"]["finish_reason"]["matched"] = "NaN happened"
    engine.engine.generate = lambda input_ids, sampling_params, return_logprob, **kw: [out]
    with pytest.raises(RuntimeError, match="NaN probabilities in prompt 0's sample"):
        engine.generate([[3]], SamplingParams(max_new_tokens=2))

"""SGLang's own abort (async_rl.chunk_tokens: null) on a GPU: generate_until stops where the caller says, the
aborted requests leave the engine with the tokens and logprobs they had, and a sample resumed from them ends as
the uncut one. The model: MEGARL_TEST_HF_MODEL (a Hugging Face directory; benchmarks/h200_async_opd.sh passes
SmolLM2-135M-Instruct), else a tiny random Llama, in bfloat16 (SGLang 0.5.17's kernels refuse float32: its rmsnorm
has no float32 dispatch), with the triton attention backend and torch sampling.

Run on an H200 with SmolLM2-135M-Instruct (benchmarks/results/h200/async_opd/README.md): the abort of hundreds of
requests and the engine's death passed; every aborted sample resumed equalled the uncut one in tokens, its
logprobs up to 0.123 apart, beyond the 0.1 bound the test then had (a tiny random model's were 0.043 apart). In
bfloat16 a logit of magnitude 20-30 is rounded by up to 0.06-0.12, and the resumed prefix is prefilled (the extend
kernels) where the uncut one was decoded: a logprob may move by about twice that. Seeded sampling is
not compared, unlike vLLM's (tests/test_rollout_vllm.py): under torch sampling a seeded generate_until and a seeded
generate agreed for 2 tokens, then parted: SGLang's per-request seed does not make the batched call and the single
requests sample alike."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from helpers import check_resumed_equals_whole, make_hf_model
from megarl.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 17, 42, 8, 120, 11], [100, 5, 9, 77, 31, 2, 54], [64, 64, 1, 19]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("sglang")
    from megarl.rollout.sglang import SGLangEngine

    model = os.environ.get("MEGARL_TEST_HF_MODEL") or str(make_hf_model(tmp_path_factory.mktemp("m"), "llama"))
    eng = SGLangEngine(model, gpu_memory_fraction=0.3, enable_sleep=False, max_model_len=256,
                       attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                       log_file=tmp_path_factory.mktemp("log") / "engine.log")
    yield eng
    eng.shutdown()


def left_in_engine(eng) -> int:
    """Requests the engine still tracks, once the scheduler's answers to the aborts have arrived."""
    manager = eng.engine.tokenizer_manager
    for _ in range(50):
        if not manager.rid_to_state:
            break
        eng.engine.loop.run_until_complete(asyncio.sleep(0.1))
    return len(manager.rid_to_state)


def test_an_aborted_sample_resumed_from_its_tokens_equals_the_whole_one(engine):
    """Greedy, same weights: the shortest budget finishes first, the rest are aborted with what they had, and each
    resumed from prompt + its tokens with the budget left ends as the uncut one, tokens and logprobs."""
    prompts = [PROMPTS[i % 3] + [i + 7] for i in range(8)]
    budgets = [3] + [48] * 7
    whole = engine.generate(prompts, SamplingParams(temperature=0, budgets=budgets))
    assert all(c.finish_reason != "abort" for c in whole)
    cut = engine.generate_until(prompts, SamplingParams(temperature=0, budgets=budgets), lambda done: len(done) >= 1)
    assert left_in_engine(engine) == 0  # the aborted requests left the engine
    assert cut[0].token_ids == whole[0].token_ids and cut[0].finish_reason == whole[0].finish_reason
    aborted = [i for i, c in enumerate(cut) if c.finish_reason == "abort"]
    assert aborted, [(c.finish_reason, len(c.token_ids)) for c in whole]
    assert all(len(cut[i].token_ids) < len(whole[i].token_ids) for i in aborted)
    assert all(len(c.logprobs) == len(c.token_ids) for c in cut)
    check_resumed_equals_whole(engine, prompts, budgets, cut, whole, tol=0.25)


def test_aborting_hundreds_of_requests_leaves_none_in_the_engine(engine):
    """More requests than one prefill admits: the abort reaches those running and those still queued."""
    many = [PROMPTS[i % 3] + [i % 200] for i in range(600)]
    cut = engine.generate_until(many, SamplingParams(temperature=1.0, max_new_tokens=200, seed=3),
                                lambda done: len(done) >= 1)
    assert left_in_engine(engine) == 0
    assert sum(c.finish_reason != "abort" for c in cut) >= 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in cut)


def test_an_engine_that_dies_during_an_abortable_call_is_an_error_not_a_hang(tmp_path):
    """The scheduler is killed from ``enough`` (between two finishes): SGLang's subprocess watchdog signals this
    process, and the call raises naming the engine instead of waiting for ever (an alarm guards the test against
    that). Its own engine: this one is gone afterwards."""
    pytest.importorskip("sglang")
    import psutil

    from megarl.rollout.sglang import SGLangEngine

    eng = SGLangEngine(str(make_hf_model(tmp_path / "m", "llama")), gpu_memory_fraction=0.2, enable_sleep=False,
                       max_model_len=256, attention_backend="triton", sampling_backend="pytorch",
                       grammar_backend="none", log_file=tmp_path / "engine.log")

    def kill(done):
        for child in psutil.Process().children(recursive=True):
            try:
                if "scheduler" in " ".join(child.cmdline()).lower():
                    child.kill()
            except psutil.Error:  # gone, or a zombie already
                pass
        return False

    def hung(*_):
        raise TimeoutError("generate_until still waits for a dead scheduler")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="SGLang engine process failed"):
            eng.generate_until(PROMPTS * 20, SamplingParams(temperature=1.0, budgets=[2, 200, 200] * 20), kill)
        assert time.monotonic() - start < 90
        with pytest.raises(RuntimeError, match="SGLang engine process failed"):
            eng.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        eng.shutdown()

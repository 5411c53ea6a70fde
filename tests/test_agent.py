"""Multi-turn, tool-using rollouts (megarl.rollout.agent) against a scripted engine, and what the trainer makes of
them (megarl.loop.rl_step): masks, logprobs, advantages and the actor's loss, against layouts and loops written by
hand."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import re
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch

from helpers import REPO, threads_as_ranks
from megarl.algos.losses import token_weights
from megarl.config import AgentConfig, AlgorithmConfig, ToolConfig, build_config
from megarl.data.batching import TokenizedPrompt
from megarl.data.prompts import PromptRecord
from megarl.errors import UserError
from megarl.eval.harness import score
from megarl.loop.rl_step import Batch, actor_loss, actor_loss_mask, advantages_and_returns, shaped_scores
from megarl.loop.rollout_manager import RolloutManager
from megarl.rollout.agent import AgentLoop, SingleTurn, agent_metrics, make_rollout
from megarl.rollout.base import Completion, SamplingParams, request_seed
from megarl.rollout.group import EngineGroup
from megarl.tools.base import ToolOutput

EOS = 0
STOP = 1  # a one-token "</tool_call>" in the vocabulary of test_one_token_delimiter_stops_the_engine
SPECIAL = {EOS: "", STOP: "</tool_call>"}
OBS = "\n<obs>{observation}</obs>\n"


def encode(text: str) -> list[int]:
    """Characters as token ids (the delimiters span many tokens)."""
    return [ord(c) for c in text]


def decode(ids: Sequence[int]) -> str:
    return "".join(SPECIAL.get(t, chr(t)) for t in ids)


class Lookup:
    name = "lookup"
    description = "capital -> country"

    def run(self, call: str) -> str:
        if call == "boom":
            raise RuntimeError("boom")
        if call == "slow":  # long enough that no loaded machine mistakes waiting for it for going on
            time.sleep(3.0)
        return {"paris": "france", "rome": "italy"}.get(call, "unknown")


class Echo:
    name = "echo"
    description = "returns its input"

    def run(self, call: str) -> str:
        return call


def logprob(context_len: int, token: int) -> float:
    return -((token * 7 + context_len) % 13 + 1) / 10


class ScriptedEngine:
    """Deterministic: the rest of the turn-th text of ``script[prompt]`` (turn = tool turns in the context so far,
    "<eos>" = EOS), cut at max_new_tokens ("length") or after a stop token ("stop"); every call recorded."""

    max_model_len = 4096

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script, self.calls = script, []  # type: ignore[var-annotated]

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        self.calls.append(([list(p) for p in prompts], params))
        out = []
        for i, prompt in enumerate(prompts):
            for _ in range(params.n):
                context = decode(prompt)
                head, _, rest = context.partition("\n")
                text = self.script[head][context.count("<obs>") + context.count("<|im_start|>tool")]
                done = re.split(r"</obs>\n|<\|im_start\|>assistant\n", rest)[-1]  # this turn's text so far
                assert text.startswith(done)
                text = text[len(done):]
                ids = encode(text.removesuffix("<eos>")) + ([EOS] if text.endswith("<eos>") else [])
                ids = [STOP if t == 0x2400 else t for t in ids]  # "␀" writes the one-token delimiter
                stop = next((k + 1 for k, t in enumerate(ids) if t in params.stop_token_ids or t == EOS), None)
                reason = "stop" if stop is not None and stop <= params.max_new_tokens else "length"
                ids = ids[: min(stop or len(ids), params.max_new_tokens)]
                out.append(Completion(prompt_index=i, token_ids=ids, finish_reason=reason,  # type: ignore[arg-type]
                                      logprobs=[logprob(len(prompt) + k, t) for k, t in enumerate(ids)]))
        return out


def loop(*tools: type, **kwargs: object) -> AgentLoop:
    cfg = AgentConfig(tools=[ToolConfig(spec=f"{__name__}:{t.__name__}") for t in tools],
                      observation_template=OBS, **kwargs)  # type: ignore[arg-type]
    return AgentLoop(cfg, encode, decode, context=4096)


def call(name: str, arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


PARAMS = SamplingParams(n=1, max_new_tokens=400, stop_token_ids=(EOS,), seed=5)


# ---- parsing ----

def test_calls_parse_as_json_or_as_plain_text_for_a_single_tool() -> None:
    two = loop(Lookup, Echo)
    assert two.parse('I will look. <tool_call> {"name": "lookup", "arguments": "rome"} </tool_call>') == ("lookup",
                                                                                                          "rome")
    assert two.parse('<tool_call>{"name": "echo", "arguments": {"a": [1, 2]}}</tool_call>') == ("echo",
                                                                                                '{"a": [1, 2]}')
    assert two.parse('{"name": "echo", "arguments": "x"}</tool_call>') == ("echo", "x")  # no opening delimiter
    bad = two.parse("<tool_call>lookup rome</tool_call>")
    assert isinstance(bad, str) and bad.startswith("error: a tool call must be JSON") and "['echo', 'lookup']" in bad
    one = loop(Lookup)
    assert one.parse("<tool_call>old<tool_call> paris </tool_call>") == ("lookup", "paris")  # the last opening
    assert one.parse("<tool_call>42</tool_call>") == ("lookup", "42")  # JSON, but not a call object


def test_bad_tool_spec_stops_at_start_up_naming_it() -> None:
    with pytest.raises(UserError, match="megarl.tools.nothere"):
        AgentLoop(AgentConfig(tools=[ToolConfig(spec="megarl.tools.nothere:Tool")]), encode, decode, 4096)


def test_a_tool_spec_error_names_its_field_and_the_flag_that_set_it(tmp_path) -> None:
    """Before any worker starts; the flag is the one that set the tool list (an earlier --set agent.max_turns was
    named), and a module that does not import is named by its field too."""
    from megarl.config import load_config
    from megarl.loop.bootstrap import check_run

    recipe, tools = str(REPO / "recipes/tiny_cpu_grpo.yaml"), "agent.tools=[{spec: calculator}]"
    with pytest.raises(UserError, match=re.escape(f"`agent.tools[0].spec` (--set {tools}) =")):
        load_config(recipe, ["agent.max_turns=2", tools])
    with pytest.raises(UserError, match=re.escape("agent.tools[0].spec = 'megarl.tools.nothere:Tool': no module "
                                                  "named 'megarl.tools.nothere'")):
        check_run(recipe, ["agent.max_turns=2", "agent.tools=[{spec: 'megarl.tools.nothere:Tool'}]",
                           f"checkpoint.dir={tmp_path}"], world=1, ranks_per_node=None, gpu_bytes=0)


BASE = {"model": {"hf_path": "/m"}, "rollout": {"num_samples_per_prompt": 4, "max_new_tokens": 256},
        "data": {"train_path": "gsm8k"}}


def test_agent_section_maps_yaml_one_to_one() -> None:
    cfg = build_config(BASE | {"agent": {
        "tools": [{"spec": "megarl.tools.calculator:Calculator"},
                  {"spec": "megarl.tools.python_exec:PythonExecutor", "args": {"timeout_s": 5}}],
        "max_turns": 3, "max_total_tokens": 200, "call_end": "</call>", "tool_timeout_s": 2}})
    a = cfg.agent
    assert [t.spec.split(":")[1] for t in a.tools] == ["Calculator", "PythonExecutor"]
    assert a.tools[1].args == {"timeout_s": 5} and a.max_turns == 3 and a.max_total_tokens == 200
    assert a.call_end == "</call>" and a.tool_timeout_s == 2.0 and a.call_start == "<tool_call>"
    assert build_config(BASE).agent.tools == []  # absent: single-turn


@pytest.mark.parametrize("agent,words", [
    ({"max_turns": 0}, ["agent.max_turns", "= 0"]),
    ({"max_total_tokens": 300}, ["agent.max_total_tokens", "300", "rollout.max_new_tokens = 256"]),
    ({"tools": [{"spec": "calculator"}]}, ["agent.tools[0].spec", "import path"]),
    ({"tools": [{"args": {}}]}, ["agent.tools[0].spec", "required"]),
    ({"observation_template": "no placeholder"}, ["agent.observation_template", "{observation} exactly once"]),
    ({"call_end": " "}, ["agent.call_end", "non-empty"]),
    ({"tool_wait_s": -1}, ["agent.tool_wait_s", "-1"]),
    ({"max_turn": 2}, ["agent.max_turn", "did you mean `max_turns`"]),
])
def test_bad_agent_values_name_the_field(agent: dict, words: list[str]) -> None:
    with pytest.raises(UserError) as info:
        build_config(BASE | {"agent": agent})
    assert all(w in str(info.value) for w in words), str(info.value)


def test_agent_settings_define_the_experiment_but_tool_workers_do_not() -> None:
    from megarl.checkpoint.resume_check import changes

    saved = build_config(BASE | {"agent": {"tools": [{"spec": "a:B"}]}}).to_flat_dict()
    for change, key in [({"tools": [{"spec": "a:C"}]}, "agent.tools"), ({"tools": [{"spec": "a:B", "args": {"x": 1}}]},
                         "agent.tools"), ({"tools": [{"spec": "a:B"}], "max_turns": 2}, "agent.max_turns"),
                        ({"tools": [{"spec": "a:B"}], "tool_workers": 2}, None),
                        ({"tools": [{"spec": "a:B"}], "tool_wait_s": 0.0, "pause_at_call_end": True}, None)]:
        found = changes(saved, build_config(BASE | {"agent": change}).to_flat_dict())
        assert [k for k, _, _ in found] == ([key] if key else []), change


class RoutingEngine(ScriptedEngine):
    """The scripted engine, returning MoE routing as SGLang does: every token it ran, prompt included, whose
    experts are a function of the token and its position (a cached prefix reports what it routed then)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        outs = super().generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            out.routed_experts = routes([*prompt, *out.token_ids][:-1])
        return outs


def routes(tokens: Sequence[int]) -> np.ndarray:
    """[len(tokens), 2 layers, top-2] expert ids."""
    t, pos = np.asarray(tokens)[:, None, None], np.arange(len(tokens))[:, None, None]
    return ((t * 3 + pos + np.arange(2)[None, :, None] * 5 + np.arange(2)[None, None, :]) % 8).astype(np.int16)


def test_routing_replay_covers_every_turn_and_tool_token_as_the_engine_ran_them() -> None:
    build_config(BASE | {"agent": {"tools": [{"spec": "a:B"}]}, "algorithm": {"routing_replay": True},
                         "rollout": {"num_samples_per_prompt": 4, "engine": "sglang"}})
    script = {"A": [call("lookup", "paris") + " junk", "It is france.<eos>"],  # ends at the end
              "B": [call("lookup", "rome") + " junk"] * 3}  # cut by max_turns at a call: its junk dropped
    outs = loop(Lookup, max_turns=2).generate(RoutingEngine(script), [encode("A\n"), encode("B\n")], PARAMS)
    for prompt, out in zip(["A\n", "B\n"], outs, strict=True):
        sequence = encode(prompt) + out.token_ids
        assert out.routed_experts is not None and 0 in out.policy_mask  # a tool turn inside
        np.testing.assert_array_equal(out.routed_experts, routes(sequence[:-1]))
    assert decode(outs[1].token_ids).endswith(call("lookup", "rome"))


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return encode(text)

    def decode(self, ids: list[int]) -> str:
        return decode(ids)


def test_trainer_rollout_is_the_engine_without_tools_and_the_loop_with_them() -> None:
    engine = ScriptedEngine({"A": [call("lookup", "rome"), "it is italy<eos>"]})
    single = make_rollout(build_config(BASE), CharTokenizer())
    assert decode(single.generate(engine, [encode("A\n")], PARAMS)[0].token_ids) == call("lookup", "rome")
    spec = {"spec": f"{__name__}:Lookup"}
    multi = make_rollout(build_config(BASE | {"agent": {"tools": [spec]}}), CharTokenizer())
    [out] = multi.generate(engine, [encode("A\n")], PARAMS)
    multi.close()
    assert multi._loop.is_closed(), "close ends the tools' event loop"
    assert decode(out.token_ids).endswith("<|im_start|>tool\nitaly<|im_end|>\n<|im_start|>assistant\nit is italy")
    with pytest.raises(UserError, match="nothere"):
        make_rollout(build_config(BASE | {"agent": {"tools": [{"spec": "nothere:Tool"}]}}), CharTokenizer())


# ---- the loop ----

def test_observation_tokens_are_inserted_and_masked_and_policy_tokens_kept_as_generated() -> None:
    first = "Let me look. " + call("lookup", "paris")
    engine = ScriptedEngine({"Q": [first + " and junk after the call", "It is france.<eos>"]})
    [out] = loop(Lookup, Echo).generate(engine, [encode("Q\n")], PARAMS)
    turn1, tool, turn2 = encode(first), encode(OBS.replace("{observation}", "france")), encode("It is france.") + [EOS]
    assert out.token_ids == turn1 + tool + turn2
    assert out.policy_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    prompt = len("Q\n")
    lp1 = [logprob(prompt + k, t) for k, t in enumerate(turn1)]
    start2 = prompt + len(turn1) + len(tool)
    assert out.logprobs == lp1 + [0.0] * len(tool) + [logprob(start2 + k, t) for k, t in enumerate(turn2)]
    assert out.finish_reason == "stop"
    assert out.stats is not None and out.stats["turns"] == 2 and out.stats["tool_calls"] == 1
    assert out.stats["tool_tokens"] == len(tool) and out.stats["tool_errors"] == 0
    # the second call continued from the whole sequence, the first call's tokens unchanged
    assert engine.calls[-1][0] == [encode("Q\n") + turn1 + tool]


def test_many_samples_in_flight_share_each_engine_call() -> None:
    script = {"A": [call("lookup", "paris"), call("lookup", "rome"), "done<eos>"],
              "B": ["no tools<eos>"],
              "C": [call("echo", "hi"), "ok<eos>"]}
    engine = ScriptedEngine(script)
    params = SamplingParams(n=2, max_new_tokens=400, stop_token_ids=(EOS,), seed=5)
    outs = loop(Lookup, Echo).generate(engine, [encode("A\n"), encode("B\n"), encode("C\n")], params)
    assert [c.prompt_index for c in outs] == [0, 0, 1, 1, 2, 2]
    assert [len(prompts) for prompts, _ in engine.calls] == [6, 4, 2]  # every live sample, one call per turn
    assert all(p.n == 1 for _, p in engine.calls)
    # sample k's c-th engine call samples at seed + k + c * 2**40, whichever samples share the call
    stride = 1 << 40
    assert [list(p.seeds or []) for _, p in engine.calls] == [
        [5 + k for k in range(6)], [5 + k + stride for k in (0, 1, 4, 5)], [5 + k + 2 * stride for k in (0, 1)]]
    assert [c.stats["turns"] for c in outs if c.stats] == [3, 3, 1, 1, 2, 2]
    assert decode(outs[0].token_ids).endswith("<obs>france</obs>\n" + call("lookup", "rome")
                                              + "\n<obs>italy</obs>\ndone")
    assert decode(outs[4].token_ids) == call("echo", "hi") + "\n<obs>hi</obs>\nok"


@pytest.mark.parametrize("wait_s", [0.1, 5.0])
def test_a_slow_tool_holds_back_its_own_sample_only(wait_s: float) -> None:
    """Sample A's tool takes 3 s, B's a moment: with agent.tool_wait_s 0.1 the engine goes on with B while
    A's tool runs, and A follows in a call of its own; waiting 5 s, both share the second call. Each sample's
    seeds, and so its tokens, are the same either way."""
    engine = TimedEngine({"A": [call("lookup", "slow"), "late<eos>"], "B": [call("lookup", "paris"), "ok<eos>"]})
    outs = loop(Lookup, tool_wait_s=wait_s).generate(engine, [encode("A\n"), encode("B\n")], PARAMS)
    batches = [[decode(p)[0] for p in prompts] for prompts, _ in engine.calls]
    stride = 1 << 40
    if wait_s < 1:
        assert batches == [["A", "B"], ["B"], ["A"]]
        assert engine.times[1] - engine.times[0] < 2.5  # B went on before A's tool (3 s) was done
        assert [list(p.seeds or []) for _, p in engine.calls] == [[5, 6], [6 + stride], [5 + stride]]
    else:
        assert batches == [["A", "B"], ["A", "B"]]
        assert [list(p.seeds or []) for _, p in engine.calls] == [[5, 6], [5 + stride, 6 + stride]]
    assert [decode(c.token_ids) for c in outs] == [call("lookup", "slow") + "\n<obs>unknown</obs>\nlate",
                                                   call("lookup", "paris") + "\n<obs>france</obs>\nok"]


class Dice:
    """Draws from the seed it is given, after a random pause: calls finish in any order."""

    name = "dice"
    description = "a random number"

    def run(self, call: str, seed: int | None = None) -> str:
        time.sleep(random.random() * 0.02)
        return str(random.Random(seed).randrange(10**6) if seed is not None else random.randrange(10**6))


@pytest.mark.parametrize("workers,wait_s", [(1, 0.0), (4, 0.0), (4, 5.0)])
def test_a_random_tool_draws_the_same_whatever_the_timing(workers: int, wait_s: float) -> None:
    """A tool that takes a seed gets its sample's (that of the turn that called it), so its results, and the
    rollout, are the same however the calls overlap, finish and group into engine calls: sample k's first call
    samples at seed + k, and its tool draws there."""
    script = {"A": [call("dice", "") + "\n", "a<eos>"], "B": [call("dice", "") + "\n", "b<eos>"]}
    params = SamplingParams(n=3, max_new_tokens=400, stop_token_ids=(EOS,), seed=5)
    agent = loop(Dice, tool_workers=workers, tool_wait_s=wait_s)
    outs = agent.generate(ScriptedEngine(script), [encode("A\n"), encode("B\n")], params)
    agent.close()
    drawn = [re.search(r"<obs>(\d+)</obs>", decode(c.token_ids)) for c in outs]
    assert [int(m.group(1)) if m else None for m in drawn] == [random.Random(5 + k).randrange(10**6) for k in range(6)]


class TimedEngine(ScriptedEngine):
    """The scripted engine, noting when each call starts."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        super().__init__(script)
        self.times: list[float] = []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        self.times.append(time.monotonic())
        return super().generate(prompts, params)


def test_max_turns_ends_a_sample_at_its_last_call_unrun() -> None:
    engine = ScriptedEngine({"A": [call("lookup", "paris")] * 5})
    [out] = loop(Lookup, max_turns=2).generate(engine, [encode("A\n")], PARAMS)
    assert decode(out.token_ids) == call("lookup", "paris") + "\n<obs>france</obs>\n" + call("lookup", "paris")
    assert out.finish_reason == "length" and out.stats is not None
    assert (out.stats["turns"], out.stats["tool_calls"], out.stats["cut_by_turns"]) == (2, 1, 1)


FIRST = call("lookup", "paris")
FRANCE = OBS.replace("{observation}", "france")


@pytest.mark.parametrize("budget,response", [(len(FIRST) + len(FRANCE) + 5, FIRST + FRANCE + "xxxxx"),
                                             (len(FIRST) - 8, FIRST[:-8])])
def test_token_budget_cuts_a_sample(budget: int, response: str) -> None:
    engine = ScriptedEngine({"A": [FIRST, "x" * 100 + "<eos>"]})
    [out] = loop(Lookup, max_total_tokens=budget).generate(engine, [encode("A\n")], PARAMS)
    assert decode(out.token_ids) == response and len(out.token_ids) == budget
    assert out.finish_reason == "length" and out.stats is not None and out.stats["cut_by_budget"] == 1
    assert out.stats["tool_calls"] == (1 if FRANCE in response else 0)
    assert engine.calls[0][1].max_new_tokens == budget


@pytest.mark.parametrize("script,budget", [(["ab<eos>"], 3), ([FIRST, "ab<eos>"], len(FIRST) + len(FRANCE) + 3)])
def test_an_end_on_the_last_budget_token_is_a_stop(script: list[str], budget: int) -> None:
    """The end-of-sequence token lands on the budget's last token ("ab" + EOS): the answer is whole, "stop" as the
    single-turn engine says for the same tokens at that max_new_tokens, not cut by the budget."""
    engine = ScriptedEngine({"A": script})
    [out] = loop(Lookup, max_total_tokens=budget).generate(engine, [encode("A\n")], PARAMS)
    assert len(out.token_ids) == budget and out.token_ids[-1] == EOS
    context = encode("A\n") + out.token_ids[:-3]  # the single-turn engine, from where the last turn starts
    [single] = ScriptedEngine({"A": script}).generate([context], dataclasses.replace(PARAMS, max_new_tokens=3))
    assert single.token_ids == out.token_ids[-3:] and single.finish_reason == "stop"
    assert out.finish_reason == "stop" and out.stats is not None and out.stats["cut_by_budget"] == 0


@pytest.mark.parametrize("context", [4096, 2 + 16])  # 2 + 16: python -m megarl.evaluate --max-new-tokens 16
def test_the_callers_max_new_tokens_bounds_the_response(context: int) -> None:
    """An eval's (or --max-new-tokens') limit of 16 holds with tools, below agent.max_total_tokens: the response,
    policy and tool tokens together, ends at 16, as the single-turn engine's would."""
    engine = ScriptedEngine({"A": [FIRST[:6] + "x" * 300 + "<eos>"]})
    agent = AgentLoop(AgentConfig(tools=[ToolConfig(spec=f"{__name__}:Lookup")], observation_template=OBS,
                                  max_total_tokens=300), encode, decode, context=context)
    params = dataclasses.replace(PARAMS, max_new_tokens=16)
    [out] = agent.generate(engine, [encode("A\n")], params)
    [single] = ScriptedEngine(engine.script).generate([encode("A\n")], params)
    assert (out.token_ids, out.finish_reason) == (single.token_ids, "length") and len(out.token_ids) == 16
    if context == 4096:  # with a tool turn: policy and tool tokens count
        script = {"A": [FIRST, "y" * 300 + "<eos>"]}
        params = dataclasses.replace(params, max_new_tokens=len(FIRST) + len(FRANCE) + 4)
        [out] = agent.generate(ScriptedEngine(script), [encode("A\n")], params)
        assert decode(out.token_ids) == FIRST + FRANCE + "yyyy" and out.finish_reason == "length"


def test_observation_that_leaves_no_room_ends_the_sample() -> None:
    engine = ScriptedEngine({"A": [FIRST, "never<eos>"]})
    [out] = loop(Lookup, max_total_tokens=len(FIRST) + len(FRANCE)).generate(engine, [encode("A\n")], PARAMS)
    assert out.token_ids == encode(FIRST) and out.policy_mask == [1] * len(FIRST)
    assert out.stats is not None and out.stats["cut_by_budget"] == 1 and out.stats["tool_calls"] == 1


def test_a_sample_cut_short_by_another_samples_context_goes_on_in_the_same_turn() -> None:
    script = {"A": ["y" * 35 + "<eos>"], "B" + "b" * 30: ["b<eos>"]}
    engine = ScriptedEngine(script)
    prompts = [encode("A\n"), encode("B" + "b" * 30 + "\n")]
    cfg = AgentConfig(tools=[ToolConfig(spec=f"{__name__}:Lookup")], observation_template=OBS, max_total_tokens=40)
    outs = AgentLoop(cfg, encode, decode, context=60).generate(engine, prompts, PARAMS)
    assert [p.max_new_tokens for _, p in engine.calls] == [60 - 32, 40 - 28]  # B's context, then A's budget
    whole = ScriptedEngine(script).generate(prompts, PARAMS)  # one call with room for everything
    for out, ref in zip(outs, whole, strict=True):
        assert (out.token_ids, out.logprobs, out.finish_reason) == (ref.token_ids, ref.logprobs, "stop")
        assert out.stats is not None and out.stats["turns"] == 1 and out.stats["cut_by_budget"] == 0


def test_a_call_split_over_two_engine_calls_is_one_call() -> None:
    """A turn cut short by another sample's context: its call opens in one engine call and closes in the next,
    the delimiter itself split between them."""
    engine = ScriptedEngine({"A": ["rome</tool_call>", "ok<eos>"], "B" + "b" * 49: ["b<eos>"]})
    agent = AgentLoop(AgentConfig(tools=[ToolConfig(spec=f"{__name__}:Lookup")], observation_template=OBS), encode,
                      decode, context=60)
    outs = agent.generate(engine, [encode("A\n"), encode("B" + "b" * 49 + "\n")],
                          dataclasses.replace(PARAMS, max_new_tokens=60))
    assert [decode(t) for t in engine.calls[1][0]] == ["A\nrome</too"]  # cut by B's context (51 + 9)
    assert decode(outs[0].token_ids) == "rome</tool_call>\n<obs>italy</obs>\nok"
    assert outs[0].stats is not None and outs[0].stats["tool_calls"] == 1 and outs[0].stats["turns"] == 2


def test_an_engine_that_gives_nothing_back_ends_the_sample() -> None:
    engine = ScriptedEngine({"A": [""]})
    [out] = loop(Lookup).generate(engine, [encode("A\n")], PARAMS)
    assert (out.token_ids, out.finish_reason, len(engine.calls)) == ([], "length", 1)


def test_tool_errors_and_timeouts_become_observations() -> None:
    script = {"A": [call("lookup", "boom"), "a<eos>"], "B": [call("lookup", "slow"), "b<eos>"],
              "C": [call("nothere", "x"), "c<eos>"], "D": ["<tool_call>not json</tool_call>", "d<eos>"]}
    engine = ScriptedEngine(script)
    start = time.monotonic()
    outs = loop(Lookup, Echo, tool_timeout_s=0.3).generate(engine, [encode(k + "\n") for k in "ABCD"], PARAMS)
    assert time.monotonic() - start < 2.5  # the slow call (3 s) was not waited for
    obs = [decode(c.token_ids).split("<obs>")[1].split("</obs>")[0] for c in outs]
    assert obs[0] == "error: RuntimeError: boom"
    assert obs[1] == "timeout after 0.3 s"
    assert obs[2].startswith("error: no tool named 'nothere'")
    assert obs[3].startswith("error: a tool call must be JSON")
    stats = [c.stats for c in outs if c.stats]
    assert [(s["tool_errors"], s["tool_timeouts"]) for s in stats] == [(1, 0), (0, 1), (1, 0), (1, 0)]
    assert stats[1]["tool_wall_s"] == pytest.approx(0.3, abs=0.2)
    assert all(c.finish_reason == "stop" for c in outs)


class BrokenSandbox:
    """A tool whose sandbox fails every call (its metadata as the Python tool's says so)."""

    name, description = "broken", "its sandbox fails"
    metadata: dict = {}

    def run(self, call: str) -> ToolOutput:
        return ToolOutput(text="sandbox failed", status="error", metadata=self.metadata)


def test_a_sandbox_that_fails_its_calls_is_counted_apart_and_said_once(monkeypatch, capsys) -> None:
    """A broken sandbox (bwrap or the cgroups failing mid-run) made every call an error, counted as the model's own
    programs' errors: training went on with no sign of it. Such calls are now agent/tool_sandbox_failures too, and
    the first prints a warning naming what the sandbox said."""
    from megarl.tools import python_exec
    from megarl.tools.sandbox import SandboxResult

    broken = SandboxResult(output="", end="sandbox failed: bwrap: Can't find source path /usr: Permission denied")
    monkeypatch.setattr(python_exec, "run_python", lambda code, config: broken)
    tool = python_exec.PythonExecutor.__new__(python_exec.PythonExecutor)
    tool.config = None
    out = tool.run("print(1)")
    assert out.status == "error" and out.metadata["sandbox_failed"] is True

    monkeypatch.setattr(BrokenSandbox, "metadata", out.metadata)
    engine = ScriptedEngine({k: [call("broken", "x"), "a<eos>"] for k in "AB"})
    outs = loop(BrokenSandbox).generate(engine, [encode("A\n"), encode("B\n")], PARAMS)
    assert [(c.stats["tool_errors"], c.stats["tool_sandbox_failures"]) for c in outs] == [(1, 1), (1, 1)]
    printed = capsys.readouterr().out
    assert printed.count("megarl: warning: a tool's sandbox failed a call") == 1 and "Permission denied" in printed


class Blocking:
    """An async tool that blocks the event loop (time.sleep inside async def): no deadline can fire."""

    name = "blocking"
    description = "blocks"

    async def run(self, call: str) -> str:
        time.sleep(float(call))
        return "slept"


def test_a_tool_that_blocks_the_tools_event_loop_stops_the_run_with_a_paragraph(monkeypatch) -> None:
    """Nothing can time out an async tool that blocks the loop: the rollout waited for it with no limit (for ever,
    with a socket read). Now no call ending well past agent.tool_timeout_s is a paragraph naming the cause."""
    from megarl.errors import UserError
    from megarl.rollout import agent

    monkeypatch.setattr(agent, "STUCK_SLACK_S", 0.5)
    engine = ScriptedEngine({"A": [call("blocking", "3"), "a<eos>"]})
    with pytest.raises(UserError, match=r"no tool call of 1 has ended in 0.7 s, though each ends at "
                                        r"agent.tool_timeout_s = 0.1 s: the tools' event loop is blocked"):
        loop(Blocking, tool_timeout_s=0.1).generate(engine, [encode("A\n")], PARAMS)  # the tool sleeps 3 s


def test_one_token_delimiter_stops_the_engine() -> None:
    cfg = AgentConfig(tools=[ToolConfig(spec=f"{__name__}:Lookup")], observation_template=OBS)
    agent = AgentLoop(cfg, lambda text: [STOP] if text == "</tool_call>" else encode(text), decode, 4096)
    engine = ScriptedEngine({"A": ["<tool_call>paris\u2400 junk", "ok<eos>"]})
    [out] = agent.generate(engine, [encode("A\n")], PARAMS)
    assert engine.calls[0][1].stop_token_ids == (EOS, STOP)
    assert out.token_ids[: len("<tool_call>paris") + 1] == encode("<tool_call>paris") + [STOP]
    assert decode(out.token_ids).endswith("<obs>france</obs>\nok")


def test_a_multi_token_delimiter_pauses_the_engine_at_its_last_token() -> None:
    """Nothing past a call is generated; a pause at the same token short of a call ('>' in <tool_call> or in
    code) goes on in the next engine call, and the tokens are those of one uninterrupted generation."""
    text = "<tool_call>print(3 > 2)</tool_call>"
    engine = ScriptedEngine({"A": [text + " junk never generated", "so 3 > 2.<eos>"]})
    [out] = loop(Lookup, pause_at_call_end=True).generate(engine, [encode("A\n")], PARAMS)
    assert all(p.stop_token_ids == (EOS, ord(">")) for _, p in engine.calls)
    assert decode(out.token_ids) == text + "\n<obs>unknown</obs>\nso 3 > 2."
    assert [c.token_ids[-1] for c in out_calls(engine)][:3] == [ord(">")] * 3  # <tool_call>, 3 >, </tool_call>
    assert out.stats is not None and out.stats["wasted_tokens"] == 0 and out.stats["engine_calls"] == 5
    assert out.logprobs[:len(text)] == [logprob(2 + k, t) for k, t in enumerate(encode(text))]


def test_by_default_the_engine_generates_past_a_call_and_the_loop_cuts_it() -> None:
    text = "<tool_call>print(3 > 2)</tool_call>"
    engine = ScriptedEngine({"A": [text + " junk", "so 3 > 2.<eos>"]})
    [out] = loop(Lookup).generate(engine, [encode("A\n")], PARAMS)  # the default
    assert all(p.stop_token_ids == (EOS,) for _, p in engine.calls)
    assert decode(out.token_ids) == text + "\n<obs>unknown</obs>\nso 3 > 2."
    assert out.stats is not None and out.stats["wasted_tokens"] == len(" junk") and out.stats["engine_calls"] == 2


def out_calls(engine: ScriptedEngine) -> list[Completion]:
    """What each recorded call of ``engine`` returned, generated again."""
    return [ScriptedEngine(engine.script).generate(prompts, params)[0] for prompts, params in engine.calls]


def test_without_tool_calls_the_rollout_is_the_single_turn_one() -> None:
    engine = ScriptedEngine({"A": ["plain answer<eos>"], "B": ["x" * 500]})
    prompts = [encode("A\n"), encode("B\n")]
    params = SamplingParams(n=3, max_new_tokens=400, stop_token_ids=(EOS,), seed=5)
    multi = loop(Lookup).generate(engine, prompts, params)
    single = engine.generate(prompts, params)
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in multi] == [
        (c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in single]
    a = Batch.build([prompts[c.prompt_index] for c in multi], [c.token_ids for c in multi],
                    [c.logprobs for c in multi], [0.0] * 6, None, [c.policy_mask for c in multi])
    b = Batch.build([prompts[c.prompt_index] for c in single], [c.token_ids for c in single],
                    [c.logprobs for c in single], [0.0] * 6)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)


class SeedEngine(ScriptedEngine):
    """The scripted engine, noting the seed each sample of each call drew at (as vLLM and SGLang give them)."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        super().__init__(script)
        self.seeds: list[list[int]] = []
        """Per call, its samples' seeds in order."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        self.seeds.append([cast(int, request_seed(params, i)) + j
                           for i in range(len(prompts)) for j in range(params.n)])
        return super().generate(prompts, params)


@pytest.mark.parametrize("tools", [False, True])
def test_no_two_samples_share_a_seed_across_engines(tools: bool) -> None:
    """Trainer.generate_all on each of 3 engines: every sample's first call draws at rollout seed + its place in the
    whole batch (prompt * n + j), as one engine would, and no seed repeats over the engines' calls."""
    script = {"A": [call("echo", "x"), "a<eos>"], "B": ["b<eos>"],
              "C": [call("echo", "y"), call("echo", "z"), "c<eos>"]}
    prompts = [encode(k + "\n") for k in "ABCAB"]
    params = SamplingParams(n=4, max_new_tokens=400, stop_token_ids=(EOS,), seed=7)
    engines, firsts = [], []  # type: ignore[var-annotated]
    for g in range(3):
        engine = SeedEngine(script)
        group = EngineGroup(index=g, num_groups=3, size=1, rank_in_group=0, members=(g,), group=None)
        fake = SimpleNamespace(engine=SimpleNamespace(group=group, generate=engine.generate), state="awake",
                               _rollout_loop=loop(Echo) if tools else SingleTurn(), _host_group=None,
                               groups=SimpleNamespace(dims=SimpleNamespace(world_size=1)))
        done = RolloutManager._generate_all(fake, prompts, params)  # type: ignore[arg-type]
        assert sorted({c.prompt_index for c in done}) == list(range(g, 5, 3))
        engines.append(engine)
        firsts += zip([p * 4 + j for p in range(g, 5, 3) for j in range(4)], engine.seeds[0], strict=True)
    assert sorted(firsts) == [(k, 7 + k) for k in range(20)]
    seeds = [s for e in engines for call in e.seeds for s in call]
    assert len(seeds) == len(set(seeds)) == 20 + 16 * tools, seeds  # A (twice) and C: 1 and 2 tool turns


def test_an_engine_that_fails_on_one_rank_stops_every_rank_in_the_same_gather(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """Two ranks' generate_all (threads standing in for processes): rank 0's engine raises. Rank 0 raises its
    error and rank 1, instead of waiting in the gather for a part that never comes (separate's generation threads,
    and through them the learners, would wait until rollout.timeout_minutes), raises one naming rank 0's."""
    import threading

    from megarl.rollout.failures import EngineFailed

    monkeypatch.setattr("torch.distributed.all_gather_object", threads_as_ranks(2))

    def broken(prompts, params):
        raise RuntimeError("engine core process ended")

    raised: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        group = EngineGroup(index=r, num_groups=2, size=1, rank_in_group=0, members=(r,), group=None)
        engine = SeedEngine({"A": ["a<eos>"], "B": ["b<eos>"]})
        fake = SimpleNamespace(engine=SimpleNamespace(group=group, generate=broken if r == 0 else engine.generate),
                               state="awake", _rollout_loop=SingleTurn(), _host_group=None,
                               groups=SimpleNamespace(rank=r, dims=SimpleNamespace(world_size=2)))
        try:
            RolloutManager._generate_all(fake, [encode("A\n"), encode("B\n")], PARAMS)  # type: ignore[arg-type]
        except BaseException as err:  # noqa: BLE001 (what each rank raised is the subject)
            raised[r] = err

    threads = [threading.Thread(target=rank, args=(r,), name=str(r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(raised[0], RuntimeError) and "engine core process ended" in str(raised[0])
    assert isinstance(raised[1], EngineFailed)
    assert str(raised[1]).startswith("rank 0's rollout engine failed, so this rank stops too: engine core process")


# ---- what the trainer makes of it ----

@pytest.mark.parametrize("tool_turns", [False, True])
def test_the_reward_reads_the_policys_text_unless_it_asks_for_the_tool_turns(tool_turns: bool) -> None:
    """A sample whose tool printed the answer and which the budget cut before it wrote one of its own: a rule
    reward reads the policy's text only (the tool call, then what it wrote after the observation), so the tool's
    output is not taken for the model's answer, in training and in evaluation alike; a reward with
    ``reads_tool_turns = True`` (a verifier of what a tool returned) reads the whole response."""
    script = {"A": [FIRST, "never answered" * 10 + "<eos>"]}
    budget = len(FIRST) + len(FRANCE) + 3
    outs = loop(Lookup, max_total_tokens=budget).generate(ScriptedEngine(script), [encode("A\n")], PARAMS)
    seen: list[str] = []

    def reward(texts: list[str], answers: list[str]) -> list[float]:
        seen.extend(texts)
        return [float(a in t) for t, a in zip(texts, answers, strict=True)]

    reward.reads_tool_turns = tool_turns  # type: ignore[attr-defined]
    cfg = SimpleNamespace(rollout=SimpleNamespace(num_samples_per_prompt=1, temperature=1.0, top_p=1.0, top_k=-1,
                                                  max_new_tokens=budget, seed=0),
                          trainer=SimpleNamespace(reward="r"), algorithm=SimpleNamespace(routing_replay=False))
    fake = SimpleNamespace(cfg=cfg, stop_ids=(EOS,), times=SimpleNamespace(timed=lambda name: contextlib.nullcontext()),
                           generate_all=lambda prompts, params: outs, scorer=reward, decode=decode,
                           groups=SimpleNamespace(rank=0, dims=SimpleNamespace(world_size=1)), _host_group=None)
    fake._score_shares = lambda rows, answers: RolloutManager._score_shares(fake, rows, answers)  # type: ignore[arg-type]
    batch = RolloutManager._rollout(fake, [encode("A\n")], ["france"], 0)  # type: ignore[arg-type]
    assert outs[0].stats is not None and outs[0].stats["cut_by_budget"] == 1
    expected = FIRST + FRANCE + "nev" if tool_turns else FIRST + "\nnev"
    assert seen == [expected] and batch.scores.tolist() == [float(tool_turns)]
    row, samples = score([TokenizedPrompt(record=PromptRecord(prompt="A", answer="france"), tokens=encode("A\n"))],
                         outs, reward, 1, decode)
    assert seen[1:] == [expected] and row["accuracy"] == float(tool_turns)
    assert samples[0].completion == FIRST + FRANCE + "nev"  # what is shown of a sample is the whole response


def test_eval_length_and_truncation_follow_trainings_conventions() -> None:
    """On one multi-turn rollout (a sample cut by the budget after a tool turn, one stopped by max_turns, one that
    ends), megarl.eval.harness's mean_length is the training row's response_length (policy tokens) and its
    truncated_fraction training's agent/cut_by_budget: max_turns is no truncation."""
    script = {"A": [FIRST, "x" * 100 + "<eos>"], "B": [FIRST, FIRST, "b<eos>"], "C": [FIRST, "c<eos>"]}
    prompts = [encode(k + "\n") for k in "ABC"]
    outs = loop(Lookup, max_turns=2, max_total_tokens=2 * len(FIRST) + len(FRANCE) + 10).generate(
        ScriptedEngine(script), prompts, PARAMS)
    assert [c.finish_reason for c in outs] == ["length", "length", "stop"]
    records = [TokenizedPrompt(record=PromptRecord(prompt=k, answer=""), tokens=p)
               for k, p in zip("ABC", prompts, strict=True)]
    row, _ = score(records, outs, lambda texts, answers: [0.0] * len(texts), 1, decode)
    batch = Batch.build(prompts, [c.token_ids for c in outs], [c.logprobs for c in outs], [0.0] * 3, None,
                        [c.policy_mask for c in outs], [c.stats for c in outs])
    training = agent_metrics(batch.stats, batch.mask)
    assert row["mean_length"] == pytest.approx(float(batch.mask.sum(dim=1).mean()))  # tracking's response_length
    assert row["truncated_fraction"] == pytest.approx(training["agent/cut_by_budget"]) == pytest.approx(1 / 3)
    assert row["agent/cut_by_turns"] == pytest.approx(training["agent/cut_by_turns"]) == pytest.approx(1 / 3)
    assert row["agent/tool_tokens"] == pytest.approx(training["agent/tool_tokens"])


def test_overlong_penalty_counts_tool_tokens_against_the_budget() -> None:
    """DAPO's penalty (budget 1024, buffer 256) measures what the budget cuts: a complete 1000-token answer loses
    (1000 - 768) / 256 of its reward, and a sample the budget cut at 600 policy + 424 tool tokens all of it."""
    algo = AlgorithmConfig(overlong_buffer_tokens=256)
    batch = Batch.build([[1, 2], [1, 2]], [[3] * 1000, [3] * 600 + [4] * 424], [[0.0] * 1000, [0.0] * 1024],
                        [1.0, 1.0], None, [None, [1] * 600 + [0] * 424])
    assert shaped_scores(batch, algo, 1024).tolist() == pytest.approx([1 - 232 / 256, 0.0])
    cfg = build_config(BASE | {"rollout": {"max_new_tokens": 2048},
                               "agent": {"tools": [{"spec": f"{__name__}:Lookup"}], "max_total_tokens": 1024}})
    assert cfg.response_budget() == 1024  # what the trainer passes



def agent_batch() -> tuple[Batch, list[list[int]]]:
    """Two multi-turn samples and a single-turn one, with the hand-written policy positions of each response."""
    script = {"A": ["ab<tool_call>rome</tool_call>", "cd<eos>"],
              "B": ["<tool_call>paris</tool_call>", "<tool_call>rome</tool_call>", "e<eos>"],
              "C": ["fgh<eos>"]}
    outs = loop(Lookup).generate(ScriptedEngine(script), [encode(k + "\n") for k in "ABC"], PARAMS)
    t1, t2 = len("ab<tool_call>rome</tool_call>"), len("<tool_call>paris</tool_call>")
    obs = len(encode(OBS.replace("{observation}", "italy")))
    obs2 = len(encode(OBS.replace("{observation}", "france")))
    t3 = len("<tool_call>rome</tool_call>")
    policy = [list(range(t1)) + [t1 + obs + k for k in range(3)],
              list(range(t2)) + [t2 + obs2 + k for k in range(t3)] + [t2 + obs2 + t3 + obs + k for k in range(2)],
              list(range(4))]
    batch = Batch.build([encode(k + "\n") for k in "ABC"], [c.token_ids for c in outs], [c.logprobs for c in outs],
                        [1.0, 0.0, 0.5], None, [c.policy_mask for c in outs], [c.stats for c in outs])
    return batch, policy


def test_batch_mask_is_the_policy_mask_and_stats_follow_select_and_concat() -> None:
    batch, policy = agent_batch()
    for i, positions in enumerate(policy):
        start = batch.prompt_lens[i] - 1
        assert batch.mask[i].nonzero().flatten().tolist() == [start + p for p in positions]
        assert (batch.rollout_logprobs[i] * (1 - batch.mask[i])).abs().sum() == 0
        assert (batch.rollout_logprobs[i][batch.mask[i] > 0] < 0).all()
    assert batch.stats["tool_calls"].tolist() == [1, 2, 0]
    both = Batch.concat([batch.select([2]), batch.select([0, 1])])
    assert both.stats["turns"].tolist() == [1, 2, 3]
    assert torch.equal(both.mask[1:, : batch.mask.shape[1]], batch.mask[:2])
    metrics = agent_metrics(both.stats, both.mask)
    tool = sum(len(b.sequences[i]) - b.prompt_lens[i] for b in [batch] for i in range(3)) - batch.mask.sum()
    assert metrics["agent/policy_token_share"] == pytest.approx(float(batch.mask.sum() / (batch.mask.sum() + tool)))
    assert metrics["agent/tool_calls"] == pytest.approx(1.0)
    assert agent_metrics({}, both.mask) == {}


def test_the_loops_own_time_is_counted_per_sample_apart_from_engine_and_tools(monkeypatch) -> None:
    """agent/loop_s: the seconds the loop spent on a sample between engine calls. A parse slowed by 50 ms shows in
    each sample by its parsed calls (2, 1, 0), in neither the engine's time nor the tools'; the step's total is the
    samples' sum, and loop_ms_per_turn that total over all turns."""
    parse = AgentLoop.parse

    def slow_parse(self, turn):
        time.sleep(0.05)
        return parse(self, turn)

    monkeypatch.setattr(AgentLoop, "parse", slow_parse)
    script = {"A": ["<tool_call>paris</tool_call>", "<tool_call>rome</tool_call>", "e<eos>"],
              "B": ["ab<tool_call>rome</tool_call>", "cd<eos>"], "C": ["fgh<eos>"]}
    outs = loop(Lookup).generate(ScriptedEngine(script), [encode(k + "\n") for k in "ABC"], PARAMS)
    loop_s = [c.stats["loop_s"] for c in outs if c.stats is not None]
    assert len(loop_s) == 3 and loop_s[0] >= 0.1 and loop_s[1] >= 0.05, loop_s
    assert loop_s[0] > loop_s[2] and loop_s[1] > loop_s[2]
    batch = Batch.build([encode(k + "\n") for k in "ABC"], [c.token_ids for c in outs], [c.logprobs for c in outs],
                        [0.0] * 3, None, [c.policy_mask for c in outs], [c.stats for c in outs])
    metrics = agent_metrics(batch.stats, batch.mask)
    assert metrics["agent/loop_s_total"] == pytest.approx(sum(loop_s), rel=1e-5)
    assert metrics["agent/loop_ms_per_turn"] == pytest.approx(1000 * sum(loop_s) / (3 + 2 + 1), rel=1e-5)
    assert metrics["agent/loop_s"] == pytest.approx(sum(loop_s) / 3, rel=1e-5)


def test_gae_bootstraps_across_tool_tokens_against_a_float64_loop() -> None:
    batch, policy = agent_batch()
    gamma, lam = 0.9, 0.8
    algo = AlgorithmConfig(name="ppo", gamma=gamma, gae_lambda=lam)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(batch.mask.shape, generator=gen)
    adv, ret, _ = advantages_and_returns(batch, algo, 1, 0.0, None, batch.rollout_logprobs, values, 400,
                                        offpolicy=None, loss_mask=batch.mask)
    assert ret is not None
    raw_all: list[float] = []
    want_ret = torch.zeros_like(ret, dtype=torch.float64)
    for i, positions in enumerate(policy):
        # the policy's tokens alone, in order: tool tokens are the environment's transition between two of them
        cols = [batch.prompt_lens[i] - 1 + p for p in positions]
        v = [float(values[i, c]) for c in cols]
        raw = [0.0] * len(cols)
        next_v = next_a = 0.0
        for k in reversed(range(len(cols))):
            r = float(batch.scores[i]) if k == len(cols) - 1 else 0.0
            raw[k] = r + gamma * next_v - v[k] + gamma * lam * next_a
            next_v, next_a = v[k], raw[k]
            want_ret[i, cols[k]] = raw[k] + v[k]
        raw_all += raw
    torch.testing.assert_close(ret.double(), want_ret, atol=1e-6, rtol=0)
    mean = sum(raw_all) / len(raw_all)
    std = (sum((a - mean) ** 2 for a in raw_all) / len(raw_all) + 1e-8) ** 0.5
    want = [(a - mean) / std for a in raw_all]
    got = [float(adv[i, batch.prompt_lens[i] - 1 + p]) for i, ps in enumerate(policy) for p in ps]
    assert got == pytest.approx(want, abs=1e-5)
    assert (adv * (1 - batch.mask)).abs().sum() == 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_actor_loss_and_gradient_of_a_multi_turn_sample_match_one_masked_sequence(aggregation: str) -> None:
    """The agent's batch through rl_step's path vs the same token sequences as one sequence each, the tool tokens'
    positions masked by hand, and the clipped objective written out per token."""
    batch, policy = agent_batch()
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.28,
                           loss_aggregation=aggregation)  # type: ignore[arg-type]
    torch.manual_seed(0)
    vocab, width = 128, batch.mask.shape[1]
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
    tokens = torch.zeros(len(batch.sequences), width + 1, dtype=torch.long)
    for i, s in enumerate(batch.sequences):
        tokens[i, : len(s)] = torch.tensor(s)

    def logprobs() -> torch.Tensor:
        logp = torch.log_softmax(model(tokens[:, :-1]).float(), dim=-1)  # the whole sequence, tool tokens too
        return logp.gather(-1, tokens[:, 1:, None])[..., 0]

    old = (logprobs().detach() + 0.1 * torch.randn(tokens.shape[0], width)) * batch.mask
    adv, _, _ = advantages_and_returns(batch, algo, 3, 0.0, None, old, None, 400, offpolicy=None, loss_mask=batch.mask)
    weights = token_weights(actor_loss_mask(batch, batch.mask), aggregation, 400)  # type: ignore[arg-type]
    loss, _ = actor_loss(logprobs(), {"old_logprobs": old, "advantages": adv, "weights": weights}, algo, 0.0)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    scores = batch.scores.tolist()
    mean = sum(scores) / 3
    std = (sum((s - mean) ** 2 for s in scores) / 2) ** 0.5
    lp = logprobs()
    terms, per_seq = [], []
    for i, positions in enumerate(policy):
        cols = [batch.prompt_lens[i] - 1 + p for p in positions]
        a = (scores[i] - mean) / (std + 1e-6)
        seq = []
        for c in cols:
            ratio = torch.exp(lp[i, c] - old[i, c])
            seq.append(-torch.minimum(ratio * a, ratio.clamp(1 - 0.2, 1 + 0.28) * a))
        terms += seq
        per_seq.append(torch.stack(seq).mean())
    want = torch.stack(terms).mean() if aggregation == "token-mean" else torch.stack(per_seq).mean()
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)

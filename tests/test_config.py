"""Config loading and validation: every kind of bad input is a UserError naming the key and a fix."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from megarl.config import (
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    build_config,
    load_config,
    validate_layout,
)
from megarl.config.yaml_io import field_docs
from megarl.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# Every section present, with values that differ from the defaults where that is cheap to check.
FULL = textwrap.dedent(
    """\
    model:
      hf_path: /models/qwen2-0.5b
      dtype: float32
      vocab_pad_multiple: 64
      transformer_engine: "off"
      recompute_activations: true
    parallel:
      tensor_parallel: 2
      pipeline_parallel: 2
      virtual_pipeline: 2
      sequence_parallel: true
      data_parallel: null
      rank_order: tp-pp-dp
      gpus_per_node: 8
      timeout_minutes: 10
    actor:
      optimizer:
        lr: 1e-6
        min_lr: 0
        lr_schedule: cosine
        num_warmup_steps: 5
        weight_decay: 0.01
        adam_beta1: 0.9
        adam_beta2: 0.95
        adam_eps: 1.0e-8
        clip_grad: 1
        use_distributed_optimizer: false
      num_ppo_epochs: 2
      mini_batch_size: 64
      dynamic_batch: false
      max_tokens_per_gpu: 4096
      micro_batch_size: 2
    critic:
      hf_path: null
      optimizer:
        lr: 2e-5
      num_ppo_epochs: 1
      mini_batch_size: 128
    rollout:
      engine: vllm
      tensor_parallel: 2
      num_samples_per_prompt: 4
      temperature: 0.8
      top_p: 0.95
      top_k: 50
      max_new_tokens: 512
      max_prompt_tokens: 256
      gpu_memory_fraction: 0.5
      seed: 7
      reshard_bucket_mb: 128
      logprob_diff_max: 1.5
    algorithm:
      name: ppo
      gamma: 0.99
      gae_lambda: 0.95
      clip_ratio_low: 0.2
      clip_ratio_high: 0.28
      dual_clip_c: 3
      value_clip: null
      entropy_coef: 0.001
      kl_coef: 0.05
      kl_estimator: k1
      kl_in_reward: true
      adaptive_kl: true
      kl_target: 0.1
      rollout_correction: token_tis
      kl_horizon: 5000
      loss_aggregation: seq-mean-token-sum
      grpo_std_normalize: false
    data:
      train_path: gsm8k
      prompt_key: q
      answer_key: a
      apply_chat_template: false
      shuffle: false
      seed: 3
      num_prompts_per_step: 32
    trainer:
      num_steps: 10
      seed: 1
      reward: megarl.rewards.gsm8k:reward
      log_every: 2
    checkpoint:
      dir: /tmp/ckpt
      save_every: 5
      keep_last: 3
      resume: none
    tracking:
      backend: none
      uri: sqlite:///x.db
      experiment: exp
      run_name: run-1
    """
)

MINIMAL: dict[str, Any] = {
    "model": {"hf_path": "/models/m"},
    "rollout": {"num_samples_per_prompt": 4},
    "data": {"train_path": "gsm8k", "num_prompts_per_step": 16},
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def with_changes(**sections: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def error_of(data: object, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(UserError) as info:
        build_config(typing.cast(dict[str, Any], data), overrides)
    return str(info.value)


def test_unquoted_on_and_off_mean_the_words_not_booleans(tmp_path: Path) -> None:
    """YAML 1.1 reads `on`/`off` as true/false: in a file and after --set they still select the choice."""
    for word in ("on", "off"):
        base = "data:\n  train_path: gsm8k\nmodel:\n  hf_path: /m\n"
        cfg = load_config(write(tmp_path, base + f"  transformer_engine: {word}\n"))
        assert cfg.model.transformer_engine == word
        cfg = load_config(write(tmp_path, base), [f"model.transformer_engine={word}"])
        assert cfg.model.transformer_engine == word
    bad = {"data": {"train_path": "gsm8k"}, "model": {"hf_path": "/m", "transformer_engine": 1}}
    assert "is not one of auto, on, off" in error_of(bad)


def test_full_recipe_loads_every_section(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FULL))
    assert cfg.model.transformer_engine == "off"
    assert cfg.parallel.rank_order == "tp-pp-dp" and cfg.parallel.virtual_pipeline == 2
    assert cfg.actor.optimizer.lr == 1e-6  # YAML 1.1 reads `1e-6` as a string
    assert isinstance(cfg.actor.optimizer.clip_grad, float)  # a YAML int is fine for a float field
    assert cfg.critic.optimizer.lr == 2e-5 and cfg.critic.optimizer.adam_beta2 == 0.999
    assert cfg.rollout.engine == "vllm" and cfg.rollout.top_k == 50
    assert cfg.algorithm.value_clip is None and cfg.algorithm.dual_clip_c == 3.0
    assert cfg.data.prompt_key == "q" and cfg.trainer.log_every == 2
    assert cfg.checkpoint.resume == "none" and cfg.tracking.run_name == "run-1"

    flat = cfg.to_flat_dict()
    assert flat["actor.optimizer.lr"] == 1e-6
    assert flat["algorithm.value_clip"] is None
    assert not any(isinstance(value, dict) for value in flat.values())

    def leaves(node: dict[str, Any], prefix: str = "") -> set[str]:
        nested = (
            leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k} for k, v in node.items()
        )
        return set().union(*nested)

    assert leaves(yaml.safe_load(FULL)) <= set(flat)
    assert cfg.to_dict()["rollout"]["engine"] == "vllm"


def test_defaults() -> None:
    cfg = build_config(MINIMAL)
    assert cfg.model.dtype == "bfloat16" and cfg.parallel.tensor_parallel == 1
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.critic.optimizer.lr == 1e-5
    assert cfg.critic.hf_path is None and cfg.actor.mini_batch_size is None
    assert cfg.trainer.reward == "megarl.rewards.gsm8k:reward"
    assert cfg.tracking.uri is None


def test_python_construction_with_defaults_is_valid() -> None:
    cfg = Config(model=ModelConfig(hf_path="/m"), data=DataConfig(train_path="gsm8k"))
    assert cfg.rollout.num_samples_per_prompt >= 2 and cfg.algorithm.name == "grpo"


def test_empty_section_means_defaults(tmp_path: Path) -> None:
    text = yaml.safe_dump(MINIMAL) + "critic:\n  # nothing overridden\n"
    assert load_config(write(tmp_path, text)).critic == CriticConfig()


def test_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump(MINIMAL))
    cfg = load_config(
        path,
        [
            "actor.optimizer.lr=1e-6",
            "critic.optimizer.lr=3.5e-5",
            "parallel.sequence_parallel=true",
            "parallel.tensor_parallel=2",
            "checkpoint.dir=null",
            "tracking.run_name=my-run",
            "rollout.num_samples_per_prompt=8",
            "model.dtype=float16",
        ],
    )
    assert cfg.actor.optimizer.lr == 1e-6 and cfg.critic.optimizer.lr == 3.5e-5
    assert cfg.parallel.sequence_parallel is True and cfg.parallel.tensor_parallel == 2
    assert cfg.checkpoint.dir is None and cfg.tracking.run_name == "my-run"
    assert cfg.rollout.num_samples_per_prompt == 8 and cfg.model.dtype == "float16"
    assert load_config(path, ["tracking.run_name=x", "tracking.run_name=null"]).tracking.run_name is None
    engine = load_config(path, ["rollout.engine_args.attention_backend=triton"]).rollout
    assert engine.engine_args == {"attention_backend": "triton"}


def test_every_field_has_a_docstring_and_every_class_is_kw_only_slots() -> None:
    def sections(cls: type) -> list[type]:
        hints = typing.get_type_hints(cls)
        nested = [hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
        return [cls, *(s for n in nested for s in sections(n))]

    for cls in sections(Config):
        assert "__slots__" in cls.__dict__, cls
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (with_changes(actr={}), ["`actr`", "not a field of Config", "did you mean `actor`?"]),
        (
            with_changes(actor={"optimizer": {"learning_rate": 1e-6}}),
            ["`actor.optimizer.learning_rate`", "OptimizerConfig", "did you mean `lr`?", "Valid: lr, min_lr"],
        ),
        (with_changes(actor={"lr": 1e-6}), ["`actor.lr`", "did you mean `optimizer.lr`?"]),
        (with_changes(parallel={"tp": 2}), ["`parallel.tp`", "did you mean `tensor_parallel`?"]),
        (with_changes(rollout={"temprature": 0.5}), ["`rollout.temprature`", "did you mean `temperature`?"]),
        (
            with_changes(actor={"num_ppo_epochs": "2"}),
            ["`actor.num_ppo_epochs`", "integer", "remove the quotes"],
        ),
        (
            with_changes(parallel={"tensor_parallel": True}),
            ["`parallel.tensor_parallel`", "= true", "booleans"],
        ),
        (with_changes(parallel={"data_parallel": True}), ["`parallel.data_parallel`", "an integer or null"]),
        (with_changes(actor={"micro_batch_size": 2.5}), ["`actor.micro_batch_size`", "= 2.5", "an integer"]),
        (with_changes(actor={"optimizer": {"lr": "fast"}}), ["`actor.optimizer.lr`", '"fast"', "a number"]),
        (with_changes(tracking={"run_name": 123}), ["`tracking.run_name`", "a string or null", "quote it"]),
        (
            with_changes(parallel={"sequence_parallel": "yes please"}),
            ["`parallel.sequence_parallel`", "true or false"],
        ),
        (with_changes(trainer={"num_steps": None}), ["`trainer.num_steps`", "= null", "delete the key"]),
        (
            with_changes(actor={"optimizer": {"lr": -1}}),
            ["`actor.optimizer.lr`", "= -1.0", "must be > 0", "Fix:"],
        ),
        (with_changes(critic={"optimizer": {"lr": 0}}), ["`critic.optimizer.lr`", "= 0.0", "> 0"]),
        (with_changes(actor={"optimizer": {"min_lr": 1e-3}}), ["`actor.optimizer.min_lr`", "[0, 1e-06]"]),
        (with_changes(rollout={"top_p": 1.5}), ["`rollout.top_p`", "= 1.5", "in (0, 1]"]),
        (with_changes(model={"logprob_chunk_tokens": -1}), ["`model.logprob_chunk_tokens`", "= -1", ">= 0", "1024"]),
        (with_changes(rollout={"top_k": 0}), ["`rollout.top_k`", "= 0", "-1 or >= 1"]),
        # The engines return full-distribution logprobs of truncated samples (benchmarks/truncated_logprobs.py).
        (with_changes(rollout={"engine": "sglang", "top_p": 0.9}),
         ["`rollout.top_p`", "= 0.9", "be 1.0 with SGLang", "0.10 nats per token at top_p", "set rollout.top_p: 1.0"]),
        (with_changes(rollout={"engine": "sglang", "top_k": 20}), ["`rollout.top_k`", "= 20", "be -1 with SGLang"]),
        (with_changes(rollout={"engine": "vllm", "top_p": 0.9}),
         ["`rollout.top_p`", "be 1.0 without algorithm.rollout_correction", "set algorithm.rollout_correction"]),
        (with_changes(rollout={"gpu_memory_fraction": 1}), ["`rollout.gpu_memory_fraction`", "(0, 1)"]),
        (with_changes(algorithm={"gamma": 1.1}), ["`algorithm.gamma`", "[0, 1]"]),
        (with_changes(algorithm={"dual_clip_c": 1}), ["`algorithm.dual_clip_c`", "> 1", "null"]),
        (
            with_changes(algorithm={"adaptive_kl": True, "kl_coef": 0.1}),
            ["`algorithm.kl_target`", "adaptive_kl"],
        ),
        (with_changes(parallel={"timeout_minutes": 0}), ["`parallel.timeout_minutes`", ">= 1"]),
        (with_changes(parallel={"network_gbps": 0}), ["`parallel.network_gbps`", "> 0"]),
        (with_changes(checkpoint={"keep_last": 0}), ["`checkpoint.keep_last`", ">= 1"]),
        (with_changes(checkpoint={"save_every": 10}), ["`checkpoint.dir`", "save_every is 10"]),
        (with_changes(trainer={"reward": "megarl.rewards.gsm8k"}), ["`trainer.reward`", "module:function"]),
        (with_changes(trainer={"reward_workers": -1}), ["`trainer.reward_workers`", "= -1", ">= 0"]),
        (with_changes(trainer={"reward": None, "reward_workers": 2}, distill={"teacher": "t"}),
         ["`trainer.reward_workers`", "= 2", "without trainer.reward"]),
        (
            with_changes(model={"dtype": "bf16"}),
            ["`model.dtype`", '"bf16"', "bfloat16, float16, float32", 'use "bfloat16"'],
        ),
        (with_changes(algorithm={"name": "dpo"}), ["`algorithm.name`", "ppo, grpo"]),
        (with_changes(parallel={"rank_order": "dp-tp-pp"}), ["`parallel.rank_order`", "tp-dp-pp"]),
        ({"data": {"train_path": "gsm8k"}}, ["`model.hf_path`", "required", "config.json"]),
        ({"model": {"hf_path": "/m"}}, ["`data.train_path`", "required"]),
        (with_changes(model={"hf_path": ""}), ["`model.hf_path`", "non-empty"]),
        ({**MINIMAL, "actor": 3}, ["`actor`", "= 3", "must be a mapping", "optimizer"]),
        ({**MINIMAL, "actor": ["x"]}, ["`actor`", "must be a mapping"]),
        (
            with_changes(parallel={"sequence_parallel": True}),
            ["`parallel.sequence_parallel`", "tensor_parallel"],
        ),
        (
            with_changes(parallel={"virtual_pipeline": 2}),
            ["`parallel.virtual_pipeline`", "pipeline_parallel is 1"],
        ),
        (
            with_changes(parallel={"virtual_pipeline": 1, "pipeline_parallel": 2}),
            ["`parallel.virtual_pipeline`"],
        ),
        # cross-section checks in Config.__post_init__
        (with_changes(rollout={"num_samples_per_prompt": 1}), ["`rollout.num_samples_per_prompt`", "grpo"]),
        (with_changes(rollout={"temperature": 0}), ["`rollout.temperature`", "greedy"]),
        (with_changes(algorithm={"name": "ppo", "dynamic_sampling": True}), ["`algorithm.dynamic_sampling`", "grpo"]),
        (with_changes(algorithm={"overlong_buffer_tokens": 5000}),
         ["`algorithm.overlong_buffer_tokens`", "max_new_tokens = 1024"]),
        (with_changes(algorithm={"rollout_correction": "tis"}), ["`algorithm.rollout_correction`", "token_tis"]),
        (with_changes(algorithm={"rollout_correction_cap": 1.0}), ["`algorithm.rollout_correction_cap`"]),
        (with_changes(rollout={"gpu_memory_fraction": "most"}),
         ["`rollout.gpu_memory_fraction`", "a number or `auto`"]),
        (with_changes(rollout={"gpu_memory_fraction": 1.5}), ["`rollout.gpu_memory_fraction`", "or auto"]),
        (with_changes(actor={"mini_batch_size": 48}), ["`actor.mini_batch_size`", "= 48", "64"]),
        (
            with_changes(algorithm={"name": "ppo"}, critic={"mini_batch_size": 5}),
            ["`critic.mini_batch_size`", "= 5"],
        ),
        (with_changes(actor={"max_tokens_per_gpu": 1000}), ["`actor.max_tokens_per_gpu`", "2048"]),
        # under sequence parallelism a row's slots round up to the TP ranks: a budget of the sample alone failed at
        # the first step that drew one that long
        (with_changes(parallel={"tensor_parallel": 2, "sequence_parallel": True}, rollout={"max_new_tokens": 1023},
                      actor={"max_tokens_per_gpu": 2047}),
         ["`actor.max_tokens_per_gpu` = 2047", "= 2047 (2048 slots: rows round up to tensor_parallel = 2"]),
        (with_changes(rollout={"engine_args": "triton"}), ["`rollout.engine_args`", "must be a mapping"]),
        (with_changes(rollout={"verify_every": -1}), ["`rollout.verify_every`", "= -1", ">= 0"]),
        (with_changes(rollout={"verify_every": 5, "engine": "vllm"}),
         ["`rollout.verify_every`", "= 5", "rollout.engine = vllm", "use rollout.engine: sglang"]),
        (with_changes(checkpoint={"stop_file": "/tmp/x.stop"}), ["`checkpoint.stop_file`", "checkpoint.dir"]),
        (with_changes(algorithm={"name": "ppo"}, rollout={"temperature": 0, "num_samples_per_prompt": 1}),
         ["`rollout.temperature`", "greedy"]),
        # async_rl: its own fields, and what the modes need of the others
        (with_changes(async_rl={"max_staleness": -1}), ["`async_rl.max_staleness`", "= -1", ">= 0"]),
        (with_changes(async_rl={"chunk_tokens": 0}), ["`async_rl.chunk_tokens`", "= 0", ">= 1"]),
        (with_changes(async_rl={"mode": "colocated_async"}),
         ["`algorithm.rollout_correction`", "decoupled PPO", "token_tis"]),
        (with_changes(async_rl={"mode": "colocated_async", "in_flight_prompts": 3},
                      algorithm={"rollout_correction": "token_tis"}),
         ["`async_rl.in_flight_prompts`", "= 3", "multiple of data.num_prompts_per_step"]),
        (with_changes(async_rl={"mode": "separate"}, rollout={"alias_weights": True},
                      algorithm={"rollout_correction": "token_tis"}), ["`rollout.alias_weights`", "own copy"]),
        (with_changes(async_rl={"mode": "separate"}),  # the fix it names must be one this mode accepts
         ["`algorithm.rollout_correction`", "token_tis (or seq_geomean_tis)", "!max_staleness: 0"]),
        (with_changes(async_rl={"mode": "colocated_async"}),
         ["`algorithm.rollout_correction`", "token_tis", "or async_rl.max_staleness: 0"]),
        (with_changes(rollout={"engine_args": {"dtype": "float16"}}),
         ["`rollout.engine_args.dtype`", '= "float16"', "model.dtype = bfloat16", "remove rollout.engine_args.dtype"]),
        (with_changes(rollout={"engine_args": {"dtype": "auto"}}), ["`rollout.engine_args.dtype`", '= "auto"']),
        # megarl's own engine settings: given here they overrode the memory plan and the hand-over's layout unseen
        (with_changes(rollout={"engine_args": {"mem_fraction_static": 0.95}}),
         ["`rollout.engine_args.mem_fraction_static`", "= 0.95", "rollout.gpu_memory_fraction", "without a word"]),
        (with_changes(rollout={"engine_args": {"tensor_parallel_size": 2}}),
         ["`rollout.engine_args.tensor_parallel_size`", "set rollout.tensor_parallel instead"]),
        (with_changes(rollout={"engine_args": {"attention_backend": "triton", "logprobs_mode": "raw_logprobs"}}),
         ["`rollout.engine_args.logprobs_mode`", "megarl sets this engine argument itself, and", "Fix: remove it."]),
        (with_changes(async_rl={"mode": "separate", "max_staleness": 0}),
         ["`async_rl.max_staleness`", "= 0", "weights of the step before"]),
        (with_changes(async_rl={"engine_gpus": -1}), ["`async_rl.engine_gpus`", "= -1", ">= 0"]),
        # an evaluation with nothing to evaluate never ran, unsaid
        (with_changes(eval={"every": 5, "datasets": []}), ["`eval.every`", "= 5", "nothing would be evaluated",
                                                           "add eval.datasets"]),
        (with_changes(eval={"before_train": True, "datasets": []}),
         ["`eval.before_train`", "eval.before_train: false"]),
        # a distillation setting without a teacher did nothing, unsaid
        (with_changes(distill={"coef": 0.3}), ["`distill.coef`", "= 0.3", "no distillation runs",
                                               "set distill.teacher"]),
        # sync mode returned before this check while the launcher still held the GPUs back
        (with_changes(async_rl={"engine_gpus": 4}), ["`async_rl.engine_gpus`", "= 4", "async_rl.mode = sync"]),
        (with_changes(async_rl={"mode": "colocated_async", "engine_gpus": 2},
                      algorithm={"rollout_correction": "token_tis"}),
         ["`async_rl.engine_gpus`", "= 2", "only separate engines"]),
        (with_changes(async_rl={"mode": "separate", "engine_gpus": 2}, rollout={"engine": "sglang"},
                      algorithm={"rollout_correction": "token_tis"}),
         ["`async_rl.engine_gpus`", "SGLang's schedulers", "rollout.engine: vllm"]),
        (with_changes(async_rl={"mode": "separate", "engine_gpus": 3}, rollout={"tensor_parallel": 2, "engine": "vllm"},
                      algorithm={"rollout_correction": "token_tis"}),
         ["`async_rl.engine_gpus`", "= 3", "multiple of rollout.tensor_parallel = 2", "use 2"]),
        (with_changes(async_rl={"mode": "colocated_async"}, algorithm={"rollout_correction": "token_tis",
                                                                      "dynamic_sampling": True}),
         ["`algorithm.dynamic_sampling`", "async_rl.mode = colocated_async"]),
        (with_changes(rollout={"temperature": float("inf")}), ["`rollout.temperature`", "be a finite number > 0"]),
        (with_changes(eval={"temperature": float("inf")}), ["`eval.temperature`", "be a finite number >= 0"]),
        (with_changes(algorithm={"adaptive_kl": True, "kl_target": float("inf")}), ["`algorithm.kl_target`"]),
        (with_changes(model={"dtype": "float16"}, rollout={"weight_dtype": "fp8"}),
         ["`rollout.weight_dtype`", "model.dtype = float16", "use model.dtype: bfloat16"]),
        (with_changes(algorithm={"kl_coef": 0.1, "kl_estimator": "k1"}),
         ["`algorithm.kl_estimator`", "= \"k1\"", "zero in expectation", "use k3 (or k2) in the loss"]),
        (with_changes(trainer={"seed": 2**64}), ["`trainer.seed`", "[0, 2147483647]"]),
        (with_changes(rollout={"seed": -3}), ["`rollout.seed`", "[0, 2147483647]"]),
        (with_changes(trainer={"num_steps": 10}, actor={"optimizer": {"num_warmup_steps": 10}}),
         ["`actor.optimizer.num_warmup_steps`", "= 10", "below trainer.num_steps (10)"]),
    ],
)
def test_bad_values(data: dict[str, Any], expected: list[str]) -> None:
    message = error_of(data)
    for part in expected:
        if part.startswith("!"):
            assert part[1:] not in message, f"{part[1:]!r} in: {message}"
        else:
            assert part in message, f"{part!r} not in: {message}"
    assert "\n" not in message


def test_an_unset_kl_estimator_follows_where_the_kl_goes() -> None:
    """k1 in the reward (its score-function gradient is KL's), k3 in the loss; k1 in the loss is allowed unused."""
    assert AlgorithmConfig(kl_coef=0.1, kl_in_reward=True).kl_estimator == "k1"
    assert AlgorithmConfig(kl_coef=0.1).kl_estimator == "k3"
    assert AlgorithmConfig(kl_estimator="k1").kl_estimator == "k1"
    assert AlgorithmConfig(kl_coef=0.1, kl_in_reward=True, kl_estimator="k3").kl_estimator == "k3"


def test_critic_is_not_checked_for_grpo() -> None:
    build_config(with_changes(critic={"mini_batch_size": 5}))


def test_error_names_file_line(tmp_path: Path) -> None:
    text = yaml.safe_dump(MINIMAL, sort_keys=False) + "actor:\n  optimizer:\n    lr: -1\n"
    with pytest.raises(UserError, match=r"`actor.optimizer.lr` \(.*recipe.yaml line 10\) = -1.0"):
        load_config(write(tmp_path, text))


def test_duplicate_key(tmp_path: Path) -> None:
    text = yaml.safe_dump(MINIMAL) + "model:\n  hf_path: /other\n"
    with pytest.raises(
        UserError, match=r"`model` is set twice \(.*recipe.yaml line \d+ and again at line \d+\)"
    ):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["actor.optimizer.lr"], ["malformed override", "`--set actor.optimizer.lr`", "dotted.key=value"]),
        (["=3"], ["malformed override"]),
        (["actor..lr=3"], ["malformed override"]),
        (
            ["actor.optimizer.learning_rate=1e-6"],
            [
                "`actor.optimizer.learning_rate`",
                "--set actor.optimizer.learning_rate=1e-6",
                "did you mean `lr`?",
            ],
        ),
        (["actr.num_ppo_epochs=2"], ["`actr`", "(--set actr.num_ppo_epochs=2)", "did you mean `actor`?"]),
        (["rollout.top_p=0.9", "rollout.top_p.x=1"], ["`rollout.top_p`", "not a section"]),
        (["rollout.top_p.x=1"], ["`rollout.top_p` (--set rollout.top_p.x=1)", "must be a number"]),
        (["actor.num_ppo_epochs=[1"], ["--set actor.num_ppo_epochs=[1", "not valid YAML"]),
        (
            ["actor.num_ppo_epochs=two"],
            ["`actor.num_ppo_epochs`", "(--set actor.num_ppo_epochs=two)", "integer"],
        ),
    ],
)
def test_bad_overrides(tmp_path: Path, overrides: list[str], expected: list[str]) -> None:
    with pytest.raises(UserError) as info:
        load_config(write(tmp_path, yaml.safe_dump(MINIMAL)), overrides)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in: {info.value}"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"config file `.*nope.yaml` does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model:\n  hf_path: x\n   dtype: y\n", ["not valid YAML", "line 3", "recipe.yaml"]),
        ("model: [1, 2\n", ["not valid YAML", "line 2"]),
        ("", ["must contain a mapping of sections", "null"]),
        ("- model\n", ["must contain a mapping of sections"]),
    ],
)
def test_bad_files(tmp_path: Path, text: str, expected: list[str]) -> None:
    with pytest.raises(UserError) as info:
        load_config(write(tmp_path, text))
    for part in expected:
        assert part in str(info.value), f"{part!r} not in: {info.value}"


def test_direct_construction_names_relative_field() -> None:
    with pytest.raises(UserError, match=r"`lr` = -1"):
        OptimizerConfig(lr=-1)


# Llama-3-8B shape: 32 layers, 32 heads, 8 kv heads, vocab 128256.
LLAMA = {"num_layers": 32, "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 128256}


def layout(world_size: int, *overrides: str, shape: dict[str, int] | None = None) -> int:
    data = with_changes(data={"num_prompts_per_step": 32})
    return validate_layout(build_config(data, overrides), world_size, **(shape or LLAMA))


def test_validate_layout_good() -> None:
    assert layout(1) == 1
    # a teacher's or reward model's MLP is split by the trainer's TP alone: the engines never serve it
    validate_layout(build_config(with_changes(data={"num_prompts_per_step": 32}), ["rollout.tensor_parallel=4"]), 4,
                    **LLAMA, ffn_size=102, served=False)
    assert (
        layout(8, "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "rollout.tensor_parallel=4")
        == 2
    )
    assert (
        layout(16, "parallel.tensor_parallel=8", "parallel.data_parallel=2", "rollout.tensor_parallel=16")
        == 2
    )
    assert layout(8, "parallel.pipeline_parallel=2", "parallel.virtual_pipeline=4") == 4
    assert layout(4, "actor.dynamic_batch=false", "actor.mini_batch_size=32", "actor.micro_batch_size=4") == 4


@pytest.mark.parametrize(
    ("world", "overrides", "shape", "expected"),
    [
        (
            8,
            ["parallel.tensor_parallel=3"],
            None,
            ["tensor_parallel * parallel.pipeline_parallel", "1, 2, 4, 8"],
        ),
        (
            8,
            ["parallel.tensor_parallel=2", "parallel.data_parallel=2"],
            None,
            ["`parallel.data_parallel`", "= 4"],
        ),
        (
            12,
            ["parallel.tensor_parallel=3"],
            None,
            ["`parallel.tensor_parallel`", "num_attention_heads = 32"],
        ),
        (
            16,
            ["parallel.tensor_parallel=16"],
            None,
            ["`parallel.tensor_parallel`", "num_kv_heads = 8", "query groups", "[1, 2, 4, 8]"],
        ),
        (6, ["parallel.pipeline_parallel=3"], None, ["`parallel.pipeline_parallel`", "num_layers = 32"]),
        (
            8,
            ["parallel.pipeline_parallel=4", "parallel.virtual_pipeline=3"],
            None,
            ["`parallel.pipeline_parallel`", "virtual_pipeline = 12"],
        ),
        (4, ["rollout.tensor_parallel=8"], None, ["`rollout.tensor_parallel`", "world size 4", "[1, 2, 4]"]),
        (
            6,
            ["rollout.tensor_parallel=3"],
            None,
            ["`rollout.tensor_parallel`", "num_attention_heads = 32", "[1, 2]"],
        ),
        (
            12,
            ["rollout.tensor_parallel=12"],
            {**LLAMA, "num_attention_heads": 48},
            ["`rollout.tensor_parallel`", "num_kv_heads = 8 or be a multiple"],
        ),
        (
            4,
            ["rollout.tensor_parallel=4"],
            {**LLAMA, "num_attention_heads": 24, "num_kv_heads": 6},
            ["`rollout.tensor_parallel`", "num_kv_heads = 6"],
        ),
        (
            3,
            ["rollout.tensor_parallel=3"],
            {"num_layers": 3, "num_attention_heads": 6, "num_kv_heads": 3, "vocab_size": 100},
            ["`rollout.tensor_parallel`", "vocabulary 128"],
        ),
        (3, ["data.num_prompts_per_step=1"], None, ["`data.num_prompts_per_step`", "data-parallel size 3"]),
        (8, ["actor.mini_batch_size=4"], None, ["`actor.mini_batch_size`", "data-parallel size 8"]),
        (
            2,
            ["actor.dynamic_batch=false", "actor.mini_batch_size=32", "actor.micro_batch_size=3"],
            None,
            ["`actor.micro_batch_size`", "per-rank mini-batch 32 / 2 = 16"],
        ),
        (
            8,
            ["algorithm.name=ppo", "critic.mini_batch_size=4"],
            None,
            ["`critic.mini_batch_size`", "data-parallel size 8"],
        ),
        (16, ["rollout.tensor_parallel=16", "parallel.gpus_per_node=8"], None,
         ["`rollout.tensor_parallel`", "= 16", "8 ranks per node", "[1, 2, 4, 8]"]),
        (8, ["parallel.tensor_parallel=2", "parallel.expert_parallel=3"], None,
         ["`parallel.expert_parallel`", "divide the data-parallel size 4", "[1, 2, 4]"]),
        (4, ["parallel.expert_parallel=2", "parallel.rank_order=tp-pp-dp"], None,
         ["`parallel.expert_parallel`", "rank_order tp-pp-dp", "rank_order: tp-dp-pp"]),
        (1, [], {**LLAMA, "num_kv_heads": 0}, ["num_key_value_heads", ">= 1"]),
        (1, [], {**LLAMA, "num_kv_heads": 5}, ["num_key_value_heads", "divide num_attention_heads"]),
        (4, ["parallel.tensor_parallel=4"], {**LLAMA, "ffn_size": 102},
         ["`parallel.tensor_parallel`", "= 4", "MLP width 102", "[1, 2]"]),
        (4, ["rollout.tensor_parallel=4"], {**LLAMA, "ffn_size": 102},
         ["`rollout.tensor_parallel`", "= 4", "MLP width 102", "[1, 2]"]),
    ],
)
def test_validate_layout_bad(
    world: int, overrides: list[str], shape: dict[str, int] | None, expected: list[str]
) -> None:
    with pytest.raises(UserError) as info:
        layout(world, *overrides, shape=shape)
    for part in expected:
        assert part in str(info.value), f"{part!r} not in: {info.value}"


def test_cli_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = write(tmp_path, yaml.safe_dump(with_changes(actor={"optimizer": {"learning_rate": 1}})))
    code = "import sys; from megarl.config import load_config; from megarl.run.command import run_main; "
    code += "run_main(lambda: load_config(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MEGARL_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", code, str(bad)], env=env, capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("megarl error: config key `actor.optimizer.learning_rate`")
    assert "did you mean `lr`?" in result.stderr

    env["MEGARL_DEBUG"] = "1"
    debug = subprocess.run([sys.executable, "-c", code, str(bad)], env=env, capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_a_rollout_longer_than_the_models_context_is_refused_before_anything_is_built(tmp_path):
    """The engines refuse it only after the models are built and the engine starts (vLLM naming no config key)."""
    from helpers import REPO
    from megarl.loop.bootstrap import check_run

    with pytest.raises(UserError, match=r"`rollout.max_new_tokens` = 1000.*together 1016 tokens, past "
                                        r"model.hf_path's max_position_embeddings \(64\)"):
        check_run(str(REPO / "recipes/tiny_cpu_grpo.yaml"), [f"checkpoint.dir={tmp_path / 'run'}",
                                                              "rollout.max_new_tokens=1000"],
                  world=1, ranks_per_node=None, gpu_bytes=0)

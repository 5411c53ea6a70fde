"""Held-out accuracy of a model: `python -m megarl.evaluate --model DIR --data NAME_OR_PATH [options]`.

DIR is a HF model directory, a megarl training checkpoint (a run's checkpoint.dir, one of its step_N
directories, or its actor directory), whose actor is exported to HF first, or a PEFT adapter directory
(``mcore-to-hf --peft``), merged by peft onto the base model its adapter_config.json names. Prompts are
built as training builds them (the same templates, system prompt and chat template); generation runs on
vLLM (CPU or GPU) or SGLang (GPU). --config RECIPE evaluates as that recipe trains: its prompt settings,
reward and token limits are the defaults, and with an ``agent:`` section the model calls its tools over
several turns as in training (the same agent loop). The last line of stdout is one JSON object: accuracy,
num_prompts, mean_length, truncated_fraction, seconds, pass@k / mean@k with --num-samples K > 1, and agent/*
means with tools.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from megarl.rollout.base import RolloutEngine
from megarl.rollout.stops import sample_stop_ids
from megarl.run.command import run_main

DTYPES = ("auto", "bfloat16", "float16", "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory, megarl checkpoint or PEFT adapter")
    parser.add_argument("--data", required=True, help='"gsm8k:test" (vendored) or a .jsonl / .parquet file')
    parser.add_argument("--config", type=Path, metavar="RECIPE",
                        help="evaluate as this training recipe does: its data.* prompt settings, trainer.reward, "
                             "rollout token limits and agent tools are the defaults of the options below")
    parser.add_argument("--reward", help='"module:function" (default: megarl.rewards.gsm8k:reward)')
    parser.add_argument("--num-samples", type=int, default=1, metavar="K", help="samples per prompt (pass@K)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-new-tokens", type=int, help="default: 1024")
    parser.add_argument("--max-prompt-tokens", type=int, help="default: 1024")
    parser.add_argument("--max-prompts", type=int, help="the first N prompts only")
    parser.add_argument("--prompt-key", help="default: question")
    parser.add_argument("--answer-key", help="default: answer")
    parser.add_argument("--prompt-template", help="format string over the record's fields (data.prompt_template)")
    parser.add_argument("--system-prompt", help="a system turn before every prompt (data.system_prompt)")
    parser.add_argument("--response-prefix", help="text every response starts with, as prompt (data.response_prefix)")
    parser.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    parser.add_argument("--engine", choices=["vllm", "sglang"], help="default: sglang on a GPU, else vllm")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="the engine's precision (default: the recipe's model.dtype with --config, a training "
                             "checkpoint's model.dtype, else a HF directory's own, auto where its config.json names "
                             "none)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.8)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", dest="engine_arg",
                        help="an argument of the engine itself, its value read as YAML (e.g. "
                             "attention_backend=triton); repeatable; over --config's rollout.engine_args, which "
                             "apply when the engine is the recipe's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write every sample (prompt, completion, reward) here")
    args = parser.parse_args(argv)
    for name in ("num_samples", "max_new_tokens", "max_prompt_tokens", "max_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    args.engine_args, args.recipe_engine = {}, None
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--engine-arg {item!r} is not KEY=VALUE (e.g. --engine-arg attention_backend=triton)")
        try:
            args.engine_args[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            parser.error(f"--engine-arg {item!r}: its value is not YAML ({' '.join(str(err).split())[:120]})")
    from megarl.config.rollout import engine_arg_megarl_sets

    if (found := engine_arg_megarl_sets(args.engine_args, EVALUATE_FLAGS)) is not None:
        key, why = found
        parser.error(f"--engine-arg {key}={args.engine_args[key]!r}: {why}")
    if not 0 <= args.temperature < math.inf:  # nan fails every comparison, so this refuses it too
        parser.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.temperature == 0 and args.num_samples > 1:
        parser.error(f"--num-samples {args.num_samples} with --temperature 0 gives {args.num_samples} identical "
                     "greedy samples; pass a temperature > 0 for pass@k")
    return args


EVALUATE_FLAGS = {"dtype": "--dtype", "model": "--model", "model_path": "--model",
                  "gpu_memory_utilization": "--gpu-memory-fraction", "mem_fraction_static": "--gpu-memory-fraction",
                  "gpu_memory_fraction": "--gpu-memory-fraction", "seed": "--seed", "random_seed": "--seed",
                  "max_model_len": "--max-prompt-tokens and --max-new-tokens (their sum)",
                  "context_length": "--max-prompt-tokens and --max-new-tokens (their sum)",
                  "tensor_parallel_size": "", "tp_size": "", "tensor_parallel": ""} | dict.fromkeys(
    ("weight_dtype", "fp8_block", "enable_lora", "max_loras", "max_lora_rank", "lora_rank", "lora_targets",
     "enable_return_routed_experts", "return_routed_experts"), "")
"""--engine-arg keys that megarl.evaluate sets itself, and the flag that sets each ("": its own, one GPU)."""

DEFAULTS = {"reward": "megarl.rewards.gsm8k:reward", "max_new_tokens": 1024, "max_prompt_tokens": 1024,
            "prompt_key": "question", "answer_key": "answer"}
"""Without --config, what the options left out take."""


def resolve(args: argparse.Namespace) -> Any:
    """Fill the options left out from --config's recipe (or DEFAULTS); the recipe's Config, or None."""
    cfg = None
    if args.config is not None:
        from megarl.config.root import build_config
        from megarl.config.yaml_io import read_yaml

        recipe, origins = read_yaml(args.config)
        # Set as it is, not as a --set: YAML would read a path like `123` or `a: b` as another type.
        model = recipe.get("model") or {}
        if isinstance(model, dict):
            recipe["model"], origins["model.hf_path"] = model | {"hf_path": args.model}, "--model"
        cfg = build_config(recipe, (), origins)
        data, rollout = cfg.data, cfg.rollout
        given: dict[str, object] = {"reward": cfg.trainer.reward, "max_new_tokens": rollout.max_new_tokens,
                 "max_prompt_tokens": rollout.max_prompt_tokens, "prompt_key": data.prompt_key,
                 "answer_key": data.answer_key, "prompt_template": data.prompt_template,
                 "system_prompt": data.system_prompt, "response_prefix": data.response_prefix,
                 "dtype": cfg.model.dtype}
        args.no_chat_template = args.no_chat_template or not data.apply_chat_template
        args.recipe_engine = (rollout.engine, rollout.engine_args)
    else:
        given = DEFAULTS
    for name, value in given.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return cfg


def hf_model(path: Path, scratch: Path) -> tuple[Path, str | None]:
    """``path`` itself when it is a HF directory; else the actor of the megarl checkpoint it names, exported, and
    the dtype its run trained in (model.dtype), so that the engine runs as the in-training eval did."""
    from megarl.checkpoint.part_check import check_part
    from megarl.errors import UserError
    from megarl.models.hf_io import write_hf
    from megarl.models.mcore_ckpt import META, open_mcore

    accepts = ("--model takes a HF model directory (config.json, *.safetensors), a megarl Megatron checkpoint "
               "(hf-to-mcore's output, a run's checkpoint.dir, one of its step_N directories, or its actor "
               "directory) or a PEFT adapter directory (adapter_config.json, from mcore-to-hf --peft).")
    if not path.is_dir():
        raise UserError(f"--model {path}: no such directory. {accepts}")
    trained = None
    if (path / "adapter_config.json").is_file():
        return merge_adapter(path, scratch), None
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
        if not path.is_dir():
            raise UserError(f"--model {path.parent}: its `latest` file names {path.name}, which is not a directory "
                            "there. Pass one of its step_N directories.")
    if (path / "actor" / META).is_file():
        trained = trained_dtype(path)
        path = path / "actor"
    if not (path / META).is_file():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {path} holds none of config.json, {META}, actor/{META}, a `latest` file or "
                            f"adapter_config.json. {accepts}")
        return path, trained
    check_part(path, "--model")
    out = scratch / "hf"
    spec, tensors = open_mcore(path)
    write_hf(out, tensors, spec, source_dir=path)
    print(f"megarl: exported the actor of {path} for evaluation", file=sys.stderr, flush=True)
    return out, trained


def merge_adapter(adapter: Path, scratch: Path) -> Path:
    """A PEFT adapter directory (``mcore-to-hf --peft``) merged by peft onto the base model its
    adapter_config.json names, as a HF directory in ``scratch``."""
    from megarl.errors import UserError
    from megarl.models.hf_io import TOKENIZER_FILES

    try:
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"--model {adapter}: adapter_config.json is unreadable ({type(err).__name__}: {err}). Fix: "
                        "export the adapter again (python -m megarl.convert mcore-to-hf --peft).") from None
    if not (Path(base) / "config.json").is_file():
        raise UserError(f"--model {adapter} is a PEFT adapter whose base model ({base!r}, its adapter_config.json's "
                        "base_model_name_or_path) is not a HF directory here. Fix: set base_model_name_or_path to "
                        "the base model's directory, or evaluate the merged export (mcore-to-hf --merge).")
    from megarl.lora.export import check_export

    check_export(adapter, base)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    out = scratch / "hf"
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(base) / name).is_file():
            shutil.copy2(Path(base) / name, out / name)
    print(f"megarl: merged the adapter {adapter} onto {base} for evaluation", file=sys.stderr, flush=True)
    return out


def trained_dtype(step_dir: Path) -> str | None:
    """model.dtype of the run that wrote the checkpoint ``step_dir`` (its trainer.json), if it says."""
    from megarl.errors import UserError

    try:
        config = json.loads((step_dir / "trainer.json").read_text()).get("config") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"--model {step_dir}: trainer.json is unreadable ({type(err).__name__}: {err}). Fix: evaluate "
                        "another checkpoint of the run, or pass its actor directory with --dtype.") from None
    return config.get("model.dtype")


def own_dtype(hf_dir: Path) -> str:
    """The dtype a HF directory's config.json names ("dtype", "torch_dtype" before transformers 5), else auto.
    Not auto for all: vLLM's auto runs float32 weights in bfloat16, of which a CPU engine without bfloat16
    instructions dies (exit -4). An engine that supports no such dtype refuses it as it starts, by name."""
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"  # the engine's start names what is wrong with the directory
    named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return named if named in DTYPES[1:] else "auto"


def engine_failed(log: Path) -> str:
    """Where the engine's log is, and what to do, after the engine failed during the evaluation."""
    return (f"The engine's log is {log}. Evaluation stopped; nothing was written. If the engine ran out of memory, "
            "lower --gpu-memory-fraction; a CPU engine whose worker died at once (exit -4) may lack the instructions "
            "of its --dtype: try --dtype float32.")


def make_engine(kind: str, model: str, args: argparse.Namespace, log_file: Path | None = None) -> RolloutEngine:
    from megarl.models.spec import load_spec

    max_len = min(args.max_prompt_tokens + args.max_new_tokens, load_spec(model).max_position_embeddings)
    recipe = args.recipe_engine  # a recipe's engine arguments are its engine's: SGLang's mean nothing to vLLM
    # the recipe's dtype is its model.dtype, which --dtype already took
    engine_args = ({k: v for k, v in recipe[1].items() if k != "dtype"} if recipe is not None and recipe[0] == kind
                   else {}) | args.engine_args
    if kind == "vllm":
        from megarl.rollout.vllm import VLLMEngine

        return VLLMEngine(model, gpu_memory_fraction=args.gpu_memory_fraction, max_model_len=max_len, seed=args.seed,
                          dtype=args.dtype, log_file=log_file, **engine_args)
    from megarl.rollout.sglang import SGLangEngine

    return SGLangEngine(model, gpu_memory_fraction=args.gpu_memory_fraction, max_model_len=max_len,
                        seed=args.seed, enable_sleep=False, dtype=args.dtype, log_file=log_file, **engine_args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = resolve(args)
    import torch

    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import load_prompts, template_fields
    from megarl.data.tokenizer import decoder, load_tokenizer
    from megarl.errors import UserError
    from megarl.eval.harness import evaluate, write_samples
    from megarl.rewards.registry import load_reward
    from megarl.rollout.agent import AgentLoop
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.failures import engine_errors
    from megarl.tools.inert import InertText

    if args.prompt_template is not None:
        template_fields(args.prompt_template, "--prompt-template")
    if args.reward is None:
        raise UserError(f"--config {args.config} has no trainer.reward (on-policy distillation alone): name the "
                        "reward that scores this evaluation with --reward, e.g. --reward megarl.rewards.gsm8k:reward.")
    reward_fn = load_reward(args.reward, "--reward")
    with tempfile.TemporaryDirectory(prefix="megarl-eval-") as scratch:
        hf_dir, trained = hf_model(Path(args.model), Path(scratch))
        model, args.dtype = str(hf_dir), args.dtype or trained or own_dtype(hf_dir)
        tokenizer = load_tokenizer(model, "--model")
        # Tools load (and bad specs stop) before the data is read and an engine starts.
        loop = None if cfg is None or not cfg.agent.tools else AgentLoop(
            cfg.agent, lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.decode,
            args.max_prompt_tokens + args.max_new_tokens, InertText.of(tokenizer))
        records = load_prompts(args.data, args.prompt_key, args.answer_key, args.prompt_template, "--data")
        records = records[:args.max_prompts]
        prompts, _ = tokenize_prompts(records, tokenizer, not args.no_chat_template, args.max_prompt_tokens,
                                      source=repr(args.data), system_prompt=args.system_prompt,
                                      response_prefix=args.response_prefix, field="--data",
                                      limit_field="--max-prompt-tokens")
        kind = args.engine or ("sglang" if torch.cuda.is_available() else "vllm")
        # The engine's output goes to a file, as in training: a dying engine's own tracebacks would bury the
        # paragraph that names its failure. Kept when the evaluation fails, whose message names it.
        handle, log_name = tempfile.mkstemp(prefix="megarl-eval-engine-", suffix=".log")
        os.close(handle)
        engine_log = Path(log_name)
        print(f"megarl: the {kind} engine's output goes to {engine_log} (removed after a successful evaluation)",
              file=sys.stderr, flush=True)
        engine = make_engine(kind, model, args, engine_log)
        stop = sample_stop_ids(tokenizer.eos_token_id, model)
        params = SamplingParams(n=args.num_samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                stop_token_ids=stop, seed=args.seed)
        calls = engine.generate if loop is None else functools.partial(loop.generate, engine)

        def generate(*call: Any, **options: Any) -> Any:
            with engine_errors("the evaluation's generation", engine_failed(engine_log)):
                return calls(*call, **options)

        try:
            result, samples = evaluate(generate, prompts, reward_fn, params, decoder(tokenizer))
        finally:
            engine.shutdown()
            if loop is not None:
                loop.close()
        engine_log.unlink()
    print(json.dumps({"model": args.model, "data": args.data, "engine": kind, "num_samples": args.num_samples}
                     | result), flush=True)
    if args.output is not None:  # after the metrics: a failed write does not lose them
        write_samples(args.output, samples, "the metrics above are complete; free space on that disk (df -h) or "
                      "name another --output, and evaluate again for the samples.")


if __name__ == "__main__":
    run_main(main)

"""The rollout engine a config asks for, started with its settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megarl.config import Config, run_dir
from megarl.rollout.base import RolloutEngine
from megarl.run import startup


def engine_class(cfg: Config) -> Any:
    if cfg.rollout.engine == "vllm":
        from megarl.rollout.vllm import VLLMEngine

        return VLLMEngine
    from megarl.rollout.sglang import SGLangEngine

    return SGLangEngine


def max_batch(cfg: Config, world_size: int) -> int:
    """The most sequences one engine generates at once in a rollout: its share of the prompts in flight (a step's,
    or with async_rl the pool's, dealt out round-robin over the engines, Config.num_engines)
    times the samples each."""
    engines = cfg.num_engines(world_size)
    prompts = cfg.async_rl.prompts_in_flight(cfg.data.num_prompts_per_step)
    return -(-prompts // engines) * cfg.rollout.num_samples_per_prompt


def engines_per_host(cfg: Config, world: int, local_world: int) -> int:
    """The engines on each host: ranks' engines are numbered in the order of their hosts (one node only when they
    have GPUs of their own, async_rl.engine_gpus)."""
    return max(1, cfg.num_engines(world) // max(1, world // local_world))


def lora_args(cfg: Config) -> dict[str, Any]:
    """actor.lora.handover: adapter: the rank the engine serves, and for SGLang, which sizes its LoRA buffers for
    named modules at start, the target modules."""
    lora = cfg.actor.lora
    assert lora is not None
    return {"lora_rank": lora.rank} | ({"lora_targets": list(lora.target_modules)} if cfg.rollout.engine == "sglang"
                                       else {})


def make_engine(cfg: Config, index: int, devices: list[int] | None, aliases: Path | None = None) -> RolloutEngine:
    """Engine ``index`` (its rollout group), logging to engine_INDEX.log in the run directory; ``aliases``: the
    file of its parameters that map the actor's memory (rollout.alias_weights). An SGLang engine captures decode
    CUDA graphs up to its rollout batch (``max_batch``; megarl.rollout.sglang.decode_graph_args)."""
    r = cfg.rollout
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # rollout.weight_dtype = fp8 starts SGLang in block FP8 (megarl.rollout.sglang_fp8); the config refuses it for vLLM
    per_engine = {"max_batch": max_batch(cfg, world), "weight_dtype": r.weight_dtype,
                  "fp8_block": r.fp8_block} if r.engine == "sglang" else {
        "cpu_engines": engines_per_host(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))}
    log_file = run_dir(cfg) / f"engine_{index}.log"
    startup.mark("models built")
    startup.engine_log(log_file)
    where = f" on GPUs {devices}" if devices is not None else ""
    print(f"megarl: starting {r.engine} engine {index} (tensor_parallel {r.tensor_parallel}){where}; its output goes "
          f"to {log_file}", flush=True)
    engine: RolloutEngine = engine_class(cfg)(
        cfg.model.hf_path, tensor_parallel=r.tensor_parallel, gpu_memory_fraction=r.gpu_memory_fraction,
        max_model_len=r.max_prompt_tokens + r.max_new_tokens, seed=r.seed + index, devices=devices,
        log_file=log_file, **({"dtype": cfg.model.dtype} | r.engine_args
                               | ({"return_routed_experts": True} if cfg.algorithm.routing_replay else {})
                               | (lora_args(cfg) if cfg.actor.adapter_handover() else {})
                               | ({"aliases": aliases} if aliases is not None else {}) | per_engine))
    startup.mark("engine start")
    return engine

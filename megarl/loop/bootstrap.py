"""Everything train.py needs before its first step: config, process groups, models, engine, data."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megarl import checkpoint
from megarl.checkpoint.best_on_resume import check_best
from megarl.checkpoint.resume_check import check_unchanged
from megarl.config import load_config, run_dir, validate_layout
from megarl.config.experiment import allowed_changes
from megarl.config.imports import import_spec
from megarl.config.yaml_io import check
from megarl.errors import UserError, raised_alike
from megarl.run import interrupt, startup
from megarl.run.lock import lock_run
from megarl.run.tracking import Tracker, logged, open_store, record_if_it_ends


def check_run(config_path: str, overrides: Sequence[str], world: int, ranks_per_node: int | None,
              gpu_bytes: int | None = None, loaded: Any = None) -> tuple[Any, Any, int, list[Any], int, Any, list[Any]]:
    """Everything that can be checked in one process before any worker starts: the config, the run
    directory, the layout against the model's shape, the memory plan and the prompts. Returns (config,
    model spec, data-parallel size, tokenized prompts, number skipped, tokenizer, eval sets). ``gpu_bytes``: one
    GPU's memory (0: no GPU); None asks torch, which a launcher must not do (it would hold a CUDA context).
    ``loaded``: the config, when the caller has read it already."""
    cfg = loaded if loaded is not None else load_config(config_path, overrides)
    out_dir = run_dir(cfg)
    check_writable(out_dir, "checkpoint.dir" if cfg.checkpoint.dir else "the default run directory (checkpoint.dir)")
    from megarl.models.spec import load_spec
    from megarl.reshard.engine_layout import check_rollout_tp

    spec = load_spec(cfg.model.hf_path, "model.hf_path")
    cfg.distill.check_teacher_dir()  # before the memory plan reads it
    cfg.reward_model.check_dir()
    check_rollout_tp(spec, cfg.rollout.tensor_parallel)
    r = cfg.rollout
    longest = r.max_prompt_tokens + r.max_new_tokens
    check(longest <= spec.max_position_embeddings, "rollout.max_new_tokens", r.max_new_tokens,
          f"fit the model's context with rollout.max_prompt_tokens ({r.max_prompt_tokens}): together {longest} "
          f"tokens, past model.hf_path's max_position_embeddings ({spec.max_position_embeddings}), which the engines "
          "refuse after the models are built",
          f"lower rollout.max_new_tokens or max_prompt_tokens to {spec.max_position_embeddings} tokens together")
    from megarl.reshard.planner import check_fp8_rollout

    check_fp8_rollout(cfg, spec)
    p = cfg.parallel
    check(not spec.is_moe or p.tensor_parallel == 1 or p.sequence_parallel, "parallel.sequence_parallel",
          p.sequence_parallel, f"be true for an MoE model ({spec.hf_config.get('architectures')}) with "
          f"tensor_parallel = {p.tensor_parallel}: Megatron's MoE layers train under TP only with it",
          "set parallel.sequence_parallel: true")
    check(not cfg.algorithm.routing_replay or spec.is_moe, "algorithm.routing_replay", True,
          f"be false for a dense model ({spec.hf_config.get('architectures')}): it has no routers",
          "set algorithm.routing_replay: false")
    check(p.expert_parallel == 1 or (spec.is_moe and spec.num_experts % p.expert_parallel == 0),
          "parallel.expert_parallel", p.expert_parallel,
          f"divide the model's expert count ({spec.num_experts})" if spec.is_moe else "be 1 for a dense model",
          "use a divisor of num_experts" if spec.is_moe else "set parallel.expert_parallel: 1")
    check_lora_rank(cfg.actor.lora, spec)
    engines, apart = cfg.num_engines(world), cfg.async_rl.engine_gpus
    check(not apart or world % engines == 0, "async_rl.engine_gpus", apart,
          f"make a number of engines (engine_gpus / rollout.tensor_parallel = {engines}) that divides the trainer's "
          f"{world} ranks: each engine is driven by an equal share of them",
          f"use {world * cfg.rollout.tensor_parallel} (one engine per trainer rank) or a divisor of that")
    check(not apart or ranks_per_node in (None, world), "async_rl.engine_gpus", apart,
          f"be 0 over {world // (ranks_per_node or world)} nodes: engines on GPUs of their own run on one node "
          "for now", "run on one node, or set async_rl.engine_gpus: 0")
    check(cfg.async_rl.mode == "sync" or cfg.async_rl.chunk_tokens is not None or engines == 1,
          "async_rl.chunk_tokens", None, f"be set with {engines} engines (world {world} / rollout.tensor_parallel "
          f"{cfg.rollout.tensor_parallel}): an engine that aborts sees only its own requests finish, so no engine "
          "could tell when the batch is done", "set async_rl.chunk_tokens: 128, or run one engine")
    for i, tool in enumerate(cfg.agent.tools):  # here, not in the workers that build them
        import_spec(tool.spec, f"agent.tools[{i}].spec = {tool.spec!r}", "Class")
    dp = validate_layout(cfg, world, num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                         num_kv_heads=spec.num_kv_heads, vocab_size=spec.vocab_size,
                         ffn_size=spec.ffn_size(spec.is_moe), ranks_per_node=ranks_per_node)
    memory_plan(cfg, spec, dp, gpu_bytes, ranks_per_node or world)
    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import load_prompts
    from megarl.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.hf_path)
    if cfg.distill.teacher is not None:
        from megarl.models.teacher import check_teacher

        teacher = check_teacher(cfg.distill.teacher, cfg.model.hf_path, tokenizer, spec)
        try:
            validate_layout(cfg, world, num_layers=teacher.num_layers, num_attention_heads=teacher.num_attention_heads,
                            num_kv_heads=teacher.num_kv_heads, vocab_size=teacher.vocab_size,
                            ffn_size=teacher.ffn_size(teacher.is_moe), ranks_per_node=ranks_per_node, served=False)
        except UserError as err:
            raise UserError(f"distill.teacher = {cfg.distill.teacher!r} does not fit the trainer's layout: {err}") \
                from None
    if cfg.reward_model.path is not None:
        check_reward_model_run(cfg, spec, tokenizer, world, ranks_per_node)
    if cfg.reward_model.judge is not None:
        check_judge(cfg.reward_model.judge)
    if cfg.critic.hf_path and cfg.algorithm.name == "ppo":
        from megarl.models.critic_init import check_critic_dir

        check_critic_dir(cfg.critic.hf_path, spec, cfg.model.hf_path)
    d = cfg.data
    records = load_prompts(d.train_path, d.prompt_key, d.answer_key, d.prompt_template)
    prompts, dropped = tokenize_prompts(records, tokenizer, d.apply_chat_template, cfg.rollout.max_prompt_tokens,
                                        d.drop_long_prompts, repr(d.train_path), d.system_prompt, d.response_prefix)
    from megarl.eval.in_training import load_eval_sets

    eval_sets = load_eval_sets(cfg, tokenizer, stop_ids(tokenizer, cfg.model.hf_path))
    return cfg, spec, dp, prompts, dropped, tokenizer, eval_sets


def check_reward_model_run(cfg: Any, spec: Any, tokenizer: Any, world: int, ranks_per_node: int | None) -> None:
    """reward_model.path: its architecture, labels, head and vocabulary (megarl.models.reward_model), its shape in
    the trainer's layout, and what another tokenizer cannot render yet."""
    from megarl.models.reward_model import check_reward_model

    path = cfg.reward_model.path
    found = check_reward_model(path, cfg.model.hf_path, tokenizer, spec)
    rm = found.spec
    try:
        validate_layout(cfg, world, num_layers=rm.num_layers, num_attention_heads=rm.num_attention_heads,
                        num_kv_heads=rm.num_kv_heads, vocab_size=rm.vocab_size, ffn_size=rm.ffn_size(rm.is_moe),
                        ranks_per_node=ranks_per_node, served=False)
    except UserError as err:
        raise UserError(f"reward_model.path = {path!r} does not fit the trainer's layout: {err}") from None
    r = cfg.rollout
    longest = r.max_prompt_tokens + r.max_new_tokens
    check(longest <= rm.max_position_embeddings, "reward_model.path", path,
          f"have a context of at least rollout.max_prompt_tokens + rollout.max_new_tokens = {longest} tokens, the "
          f"longest conversation it may score: its max_position_embeddings is {rm.max_position_embeddings}, and past "
          "it the scores are out of what it was trained on (nothing would fail)",
          f"lower rollout.max_new_tokens or max_prompt_tokens to {rm.max_position_embeddings} tokens together, or "
          "use a reward model with a longer context")
    check(found.shares_tokens or not cfg.agent.tools, "reward_model.path", path,
          "share the policy's tokenizer and chat template with agent.tools: a multi-turn sample's tool turns are not "
          "rendered again for another tokenizer yet", "use a reward model of the policy's family, or no tools")
    check(found.shares_tokens or cfg.async_rl.mode == "sync", "reward_model.path", path,
          f"share the policy's tokenizer and chat template with async_rl.mode = {cfg.async_rl.mode}: samples carried "
          "across steps are not rendered again for another tokenizer yet (their prompts' text is not kept)",
          "use a reward model of the policy's family, or async_rl.mode: sync")


def check_judge(judge: Any) -> None:
    """reward_model.judge: its model directory and tokenizer, its context against the model's positions, its engine
    layout, and the parse function (imported here, before any worker starts)."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.models.spec import load_spec
    from megarl.reshard.engine_layout import check_rollout_tp
    from megarl.rewards.judge import load_parse

    load_tokenizer(judge.model, "reward_model.judge.model")
    found = load_spec(judge.model, "reward_model.judge.model")
    longest = judge.max_prompt_tokens + judge.max_new_tokens
    check(longest <= found.max_position_embeddings, "reward_model.judge.max_prompt_tokens", judge.max_prompt_tokens,
          f"leave, with max_new_tokens = {judge.max_new_tokens}, at most the judge's max_position_embeddings = "
          f"{found.max_position_embeddings} tokens ({judge.model})",
          f"set it to at most {found.max_position_embeddings - judge.max_new_tokens}")
    check_rollout_tp(found, judge.tensor_parallel, field="reward_model.judge.tensor_parallel")
    load_parse(judge.parse)


def stop_ids(tokenizer: Any, hf_path: str) -> tuple[int, ...]:
    """Generation stops at the tokenizer's EOS and the model's own (megarl.rollout.stops.sample_stop_ids)."""
    from megarl.rollout.stops import sample_stop_ids

    return sample_stop_ids(tokenizer.eos_token_id, hf_path)


EXPECTED_WARNINGS = (
    r".*(Transformer Engine and Apex are|Apex is) not installed",  # torch fallbacks, by design without TE
    r"full scope is deprecated",  # megatron-core's own default for cuda_graph_scope
    r"`torch\.distributed\.\w+` is deprecated",  # megatron-core's calls into torch
    r"The \.grad attribute of a Tensor that is not a leaf",  # megatron-core reads main_grad's owner
)
"""Warnings of libraries that say nothing to a megarl user; shown with MEGARL_WARNINGS=all."""


def quiet_expected_warnings() -> None:
    if os.environ.get("MEGARL_WARNINGS") == "all":
        return
    import warnings

    for message in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def setup(config_path: str, overrides: Sequence[str]
          ) -> tuple[Any, Any, Any, Callable[[list[int]], str], Any, Any]:
    startup.mark("imports")
    quiet_expected_warnings()
    standalone_env()
    interrupt.install()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    cfg = load_config(config_path, overrides)
    hand_over = record_if_it_ends(cfg, run_dir(cfg))  # the mlflow run of a start-up that fails or is interrupted
    cfg, spec, dp, prompts, dropped, tokenizer, eval_sets = check_run(
        config_path, overrides, int(os.environ["WORLD_SIZE"]), int(local) if local else None, loaded=cfg)
    startup.mark("config and data")
    out_dir = run_dir(cfg)
    from megarl.data.loader import PromptLoader

    loader = PromptLoader(prompts, cfg.data.num_prompts_per_step, cfg.data.shuffle, cfg.data.seed,
                          key=lambda p: [p.record.prompt, p.record.answer])

    from megarl.platform import init_platform

    platform = init_platform()
    if platform.device.type == "cuda":
        from megarl.reshard.kernels import check_cuda_build

        check_cuda_build()
    from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel, model_parallel_seed

    init_distributed(platform, cfg.parallel.timeout_minutes)
    field = "checkpoint.dir" if cfg.checkpoint.dir else "the default run directory (checkpoint.dir)"
    with raised_alike():  # every rank checks the same directory, and below the same checkpoint
        lock_run(out_dir, field, platform.device)  # before anything is written there
    p = cfg.parallel
    groups = init_model_parallel(ParallelDims(tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=dp,
                                              vpp=p.virtual_pipeline, order=p.rank_order, ep=p.expert_parallel),
                                 p.timeout_minutes)
    model_parallel_seed(cfg.trainer.seed)
    if groups.rank == 0 and cfg.tracking.backend == "mlflow":
        open_store(cfg, out_dir)  # a bad tracking.uri fails now, not after the models are built
    if groups.rank == 0:
        skipped = f" ({dropped} longer than rollout.max_prompt_tokens skipped)" if dropped else ""
        print(f"megarl: {len(prompts)} prompts{skipped}; TP={p.tensor_parallel} PP={p.pipeline_parallel} DP={dp}",
              flush=True)
        from megarl.reshard.planner import fp8_rollout_warning

        if (warning := fp8_rollout_warning(cfg)) is not None:
            print(warning, flush=True)
        from megarl.checkpoint.notes import no_checkpoint_note
        from megarl.loop.partial_rollouts import mps_note, prefill_note
        from megarl.rollout.sglang_notes import deterministic_note

        for note in (prefill_note(cfg), mps_note(cfg, on_cuda=platform.device.type == "cuda"), deterministic_note(cfg),
                     no_checkpoint_note(cfg)):
            if note is not None:
                print(note, flush=True)
    from megarl.loop.trainer import RLTrainer

    with raised_alike():
        resume_from = checkpoint.find(cfg.checkpoint.resume, cfg.checkpoint.dir)  # verified, before anything is built
    allowed = set(allowed_changes(cfg.checkpoint.allow_changes))
    other_prompts = bool(allowed & {"data.train_path", "data.prompt_template", "data.prompt_key", "data.answer_key"})
    if resume_from is not None:
        with raised_alike():
            saved_loader = check_unchanged(cfg, resume_from, groups.rank).get("loader")
            if saved_loader is not None:
                loader.check_state(saved_loader, other_prompts)
    startup.mark("process groups")
    stops = stop_ids(tokenizer, cfg.model.hf_path)
    trainer = RLTrainer(cfg, groups, stops, tokenizer)  # models, engine (factory's marks), first push
    startup.mark("first weight push")
    start_step, run_id, unlogged = 0, None, None
    if resume_from is not None:
        trainer.sleep_engine()  # the restored state needs the memory
        state = checkpoint.load(resume_from, trainer.trained_models(), prepare=trainer.hold_for_checkpoint)
        loader.load_state_dict(state["loader"], other_prompts)
        trainer.kl.load_state_dict(state["kl"])
        if trainer.reward_model is not None:  # reward_model.normalize's running statistics
            trainer.reward_model.load_state_dict(state.get("reward_model"))
        trainer.rollout.load_state_dict(state.get("rollout", {}))  # samples in flight (async_rl)
        trainer.push_weights()  # the engine must generate with the restored weights
        start_step = state["step"] + 1
        run_id = state.get("tracking", {}).get("mlflow_run_id")
        unlogged = state.get("unlogged")  # the step's row, unless the run logged it after the save
        if unlogged is not None and logged(out_dir, state["step"], groups.rank):
            unlogged = None
        if groups.rank == 0:
            print(f"megarl: resumed from {resume_from} at step {start_step}", flush=True)
    trainer.step_metrics()  # the first push and a resume's restore are start-up, not parts of the first step's row
    check_best(out_dir, cfg.checkpoint.keep_best, start_step, groups.rank)
    tracker = Tracker(cfg, groups.rank, out_dir, start_step, run_id, unlogged)
    interrupt.at_interrupt(trainer.close)
    tracker.end_with_the_process()
    hand_over()

    from megarl.eval.in_training import InTrainingEval

    return cfg, trainer, loader, trainer.rollout.decode, tracker, InTrainingEval(cfg, eval_sets, out_dir, groups.rank)


def check_lora_rank(lora: Any, spec: Any) -> None:
    """An adapter of rank r on a layer d_in -> d_out is low-rank only for r below both widths; at or past the
    narrower one it is a full update stored as two (rank 4096 on 128-wide layers was accepted)."""
    if lora is None or not lora.rank:
        return
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    widths = {"qkv": (spec.hidden_size, q + 2 * kv), "o": (q, spec.hidden_size),
              "fc1": (spec.hidden_size, 2 * spec.intermediate_size), "fc2": (spec.intermediate_size, spec.hidden_size)}
    narrowest = min(min(widths[t]) for t in lora.target_modules)
    check(lora.rank < narrowest, "actor.lora.rank", lora.rank,
          f"be below the narrowest width of its target layers ({narrowest} for {list(lora.target_modules)} of "
          f"{spec.hf_config.get('architectures')}): at that width an adapter is no longer low-rank",
          f"use a rank such as 8, 16 or 64 (below {narrowest}), or train the full weights (rank: 0)")


def memory_plan(cfg: Any, spec: Any, dp: int, gpu_bytes: int | None = None, gpus_per_node: int = 1) -> None:
    """On GPUs: check the per-GPU memory plan and the node's host memory (megarl.memory.plan) and resolve
    rollout.gpu_memory_fraction: auto, before anything is built. Without a GPU (CPU engines) auto leaves
    the engine its own default."""
    import torch

    from megarl.distributed.parallel import ParallelDims
    from megarl.memory.plan import check_host_memory, check_memory, plan_memory

    if gpu_bytes is None:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    if not gpu_bytes:
        if cfg.rollout.gpu_memory_fraction == "auto":
            cfg.rollout.gpu_memory_fraction = None
        return
    p = cfg.parallel
    dims = ParallelDims(tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=dp, vpp=p.virtual_pipeline,
                        ep=p.expert_parallel)
    plan = plan_memory(cfg, spec, dims, gpu_bytes)
    check_memory(plan, cfg, dims.world_size)
    check_host_memory(plan, cfg, gpus_per_node, host_memory_bytes())
    cfg.rollout.gpu_memory_fraction = plan.engine_fraction
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megarl: memory plan per GPU: {plan.table()}; engine fraction "
              f"{cfg.rollout.gpu_memory_fraction:.2f}; pinned host buffers {plan.host_bytes() / 2**30:.1f} GiB",
              flush=True)


def host_memory_bytes() -> int:
    """This node's memory, or this process's cgroup limit where lower (a Slurm job runs inside one)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # cgroup v2
                limits.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max")
            elif "memory" in controllers.split(","):
                limits.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    for limit in limits:
        try:
            value = limit.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            total = min(total, int(value))
    return total


def check_writable(directory: Path, field: str) -> None:
    """Fail in a second, before anything is built, when the run directory cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_test.{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UserError(f"{field} = {str(directory)!r} cannot be written ({err.strerror or err}): metrics, "
                        "checkpoints and the mlflow store go there. Fix: point checkpoint.dir at a writable "
                        "directory, or fix its permissions.") from None


def standalone_env() -> None:
    """Without torchrun (``python megarl/train.py``), run as a world of one process; it names no port, so
    megarl.distributed.parallel.init_distributed meets in the process's own memory."""
    if "RANK" in os.environ:
        return
    os.environ.pop("MASTER_PORT", None)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")

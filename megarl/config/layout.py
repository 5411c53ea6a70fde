"""Checks of the parallel layouts against the world size and the model's shape (after load_config)."""

from __future__ import annotations

import math

from megarl.config.root import Config
from megarl.config.yaml_io import check


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rollout_tp_problem(r: int, world_size: int, heads: int, kv_heads: int, vocab_size: int,
                        ffn_size: int | None = None) -> str | None:
    """Why engines of tensor-parallel size `r` cannot serve this model on this world, or None."""
    if world_size % r:
        return f"divide the world size {world_size}"
    if heads % r:
        return f"divide the model's num_attention_heads = {heads}"
    if ffn_size is not None and ffn_size % r:
        return f"divide the model's MLP width {ffn_size} (the engine splits it over its ranks)"
    # Engines replicate kv heads when R > num_kv_heads, which needs each kv head on a whole number
    # of ranks; otherwise each rank must own a whole number of kv heads.
    if (r % kv_heads if r > kv_heads else kv_heads % r) != 0:
        return f"divide the model's num_kv_heads = {kv_heads} or be a multiple of it"
    padded = -(-vocab_size // 64) * 64
    if padded % r:
        return f"divide the engine's vocabulary {padded} (vocab_size {vocab_size} padded to a multiple of 64)"
    return None


def validate_layout(
    cfg: Config,
    world_size: int,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    ffn_size: int | None = None,
    ranks_per_node: int | None = None,
    served: bool = True,
) -> int:
    """Check the trainer and rollout layouts against the world size, the ranks per node (when known:
    parallel.gpus_per_node, else torchrun's LOCAL_WORLD_SIZE) and the model's shape (from its
    config.json; ``ffn_size``: the MLP's width, an expert's in a MoE model; ``served``: the engines serve it, as the
    policy, not a teacher or a reward model, whose MLP they never split); return the data-parallel size."""
    shape = {
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
    }
    for name, value in shape.items():
        check(
            value >= 1, f"model.hf_path config.json {name}", value, "be >= 1", "fix the model's config.json"
        )
    check(
        num_attention_heads % num_kv_heads == 0,
        "model.hf_path config.json num_key_value_heads",
        num_kv_heads,
        f"divide num_attention_heads = {num_attention_heads}",
        "fix the model's config.json",
    )
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    check(
        world_size % (tp * pp) == 0,
        "parallel.tensor_parallel * parallel.pipeline_parallel",
        tp * pp,
        f"divide the world size {world_size}",
        f"choose TP and PP whose product is one of {_divisors(world_size)}, or launch more ranks",
    )
    dp = world_size // (tp * pp)
    check(dp % p.expert_parallel == 0, "parallel.expert_parallel", p.expert_parallel,
          f"divide the data-parallel size {dp} (experts are split over DP ranks)",
          f"use one of {_divisors(dp)}")
    check(
        p.data_parallel is None or p.data_parallel == dp,
        "parallel.data_parallel",
        p.data_parallel,
        f"equal world size / (TP * PP) = {world_size} / {tp * pp} = {dp}",
        f"set it to {dp}, or null to derive it",
    )
    ffn = ffn_size or 0  # unknown: divisible by any size
    valid_tp = [d for d in _divisors(world_size)
                if num_attention_heads % d == 0 and num_kv_heads % d == 0 and ffn % d == 0]
    check(
        num_attention_heads % tp == 0 and num_kv_heads % tp == 0,
        "parallel.tensor_parallel",
        tp,
        f"divide the model's num_attention_heads = {num_attention_heads} and num_kv_heads = {num_kv_heads} "
        "(Megatron splits query groups over TP)",
        f"use one of {valid_tp}",
    )
    check(ffn % tp == 0, "parallel.tensor_parallel", tp,
          f"divide the model's MLP width {ffn_size} (Megatron splits it over TP)", f"use one of {valid_tp}")
    stages = pp * (p.virtual_pipeline or 1)
    check(
        num_layers % stages == 0,
        "parallel.pipeline_parallel",
        pp,
        f"split num_layers = {num_layers} evenly, but pipeline_parallel * virtual_pipeline = {stages} "
        "does not divide it",
        f"make pipeline_parallel (times virtual_pipeline, if set) one of {_divisors(num_layers)}",
    )

    r = cfg.rollout.tensor_parallel
    engine_ffn = ffn_size if served else None
    problem = _rollout_tp_problem(r, world_size, num_attention_heads, num_kv_heads, vocab_size, engine_ffn)
    valid_r = [
        d
        for d in _divisors(world_size)
        if not _rollout_tp_problem(d, world_size, num_attention_heads, num_kv_heads, vocab_size, engine_ffn)
    ]
    check(problem is None, "rollout.tensor_parallel", r, str(problem), f"use one of {valid_r}")
    per_node = p.gpus_per_node or ranks_per_node
    check(per_node is None or per_node % r == 0, "rollout.tensor_parallel", r,
          f"divide the {per_node} ranks per node (an engine runs on the GPUs of one node)",
          f"use one of {[d for d in valid_r if per_node and per_node % d == 0]}")

    n = cfg.rollout.num_samples_per_prompt
    batch = cfg.data.num_prompts_per_step * n
    check(
        batch % dp == 0,
        "data.num_prompts_per_step",
        cfg.data.num_prompts_per_step,
        f"give a rollout batch (times rollout.num_samples_per_prompt {n} = {batch}) that the "
        f"data-parallel size {dp} divides",
        f"use a multiple of {dp // math.gcd(dp, n)}",
    )
    for name, section in cfg.trained_sections():
        mini = section.mini_batch_size or batch
        check(
            mini % dp == 0,
            f"{name}.mini_batch_size",
            section.mini_batch_size,
            f"be divisible by the data-parallel size {dp} (each rank takes an equal share)",
            f"use a multiple of {dp} that divides the rollout batch {batch}",
        )
        per_rank = mini // dp
        check(
            section.dynamic_batch or per_rank % section.micro_batch_size == 0,
            f"{name}.micro_batch_size",
            section.micro_batch_size,
            f"divide the per-rank mini-batch {mini} / {dp} = {per_rank}",
            f"use one of {_divisors(per_rank)}, or dynamic_batch: true",
        )
    return dp

"""Multi-rank worker for test_lora_layouts.py: LoRA adapters (megarl.lora) under TP2, TP2 with sequence parallelism
and PP2 give the loss and adapter gradients of TP1, in one launch.

torchrun --nproc-per-node 2 tests/workers/lora.py OUT_DIR LLAMA_DIR QWEN2_DIR
Every layout adapts all four targets with the same A (apply_lora draws them per layer) and the same B (drawn here
whole, in TP1's layout, and cut into this rank's shard), runs one forward and backward through Megatron's schedule
and DDP (whose finalize_model_grads sums the sequence-parallel factors' gradients over TP), and gathers each
adapter's gradients to TP1's layout. Each rank writes, per layout, the largest differences from TP1's loss and
gradients, from the merged-weight model's loss, and between TP ranks' copies of the replicated factors.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl.config.lora import LoraConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.lora.layers import apply_lora, merged_weights  # noqa: E402
from megarl.models.gpt import BuildOptions, build_model, load_hf_weights  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402

# (model, TP, PP, sequence parallel); the first layout of each model is its reference.
RUNS = [("llama", 1, 1, False), ("llama", 2, 1, False), ("llama", 2, 1, True), ("llama", 1, 2, False),
        ("qwen2", 1, 1, False), ("qwen2", 2, 1, True)]
TARGETS = {"qkv": ("self_attention", "linear_qkv"), "o": ("self_attention", "linear_proj"),
           "fc1": ("mlp", "linear_fc1"), "fc2": ("mlp", "linear_fc2")}
CFG = LoraConfig(rank=4, alpha=8.0, target_modules=list(TARGETS))


def column_shard(full: torch.Tensor, target: str, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's rows of a column-parallel tensor in TP1's layout: fc1 is [gate; up], each split over TP."""
    if target == "fc1":
        return torch.cat([part.chunk(tp)[rank] for part in full.chunk(2)])
    return full.chunk(tp)[rank]  # QKV's query groups lie whole and in order on consecutive ranks


def column_unshard(parts: list[torch.Tensor], target: str) -> torch.Tensor:
    if target == "fc1":
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts)


def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def adapted(chunks) -> dict[tuple[int, str], torch.nn.Module]:
    return {(layer.layer_number, target): getattr(getattr(layer, holder), name)
            for chunk in chunks for layer in chunk.decoder.layers for target, (holder, name) in TARGETS.items()}


def set_b(linears, tp_rank: int, tp: int) -> None:
    with torch.no_grad():
        for (layer, target), linear in linears.items():
            gen = torch.Generator().manual_seed(100 * layer + list(TARGETS).index(target))
            column = target in ("qkv", "fc1")
            out = linear.lora.B.shape[0] * (tp if column else 1)
            full = torch.randn(out, CFG.rank, generator=gen) * 0.05
            linear.lora.B.copy_(column_shard(full, target, tp_rank, tp) if column else full)


def loss_and_grads(chunks, groups, ids: torch.Tensor, train: bool) -> float | None:
    """Mean next-token loss of ``ids`` through Megatron's schedule (with backward when ``train``); None off the last
    stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(ids.shape[1]).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)

    def forward_step(it, model):
        next(it)
        out = model(input_ids=ids, position_ids=positions, attention_mask=None, labels=labels)
        # The last position has no next token; DDP averages the identical DP replicas' gradients.
        return out, lambda o: (o[:, :-1].float().mean(), {"loss": o[:, :-1].float().mean().detach()})

    rows = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=chunks,
                                       num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                       forward_only=not train)
    return float(rows[0]["loss"]) if groups.is_last_stage else None


def main() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    out_dir, models = Path(sys.argv[1]), {"llama": sys.argv[2], "qwen2": sys.argv[3]}
    init_distributed(platform)
    world = dist.get_world_size()
    results, reference = [], {}
    for name, tp, pp, sp in RUNS:
        spec = load_spec(models[name])
        ids = torch.randint(0, spec.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)))
        model_parallel_seed(1)
        opts = BuildOptions(sequence_parallel=sp)
        chunks = build_model(spec, groups, opts)
        load_hf_weights(chunks, spec, models[name], groups, opts)
        apply_lora(chunks, CFG)
        linears = adapted(chunks)
        set_b(linears, groups.tp_rank, tp)
        merged = [merged_weights(c) for c in chunks]
        ddp = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=c)
               for c in chunks]
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        loss = loss_and_grads(ddp, groups, ids, train=True)
        grads, spread = {}, 0.0
        for (layer, target), linear in linears.items():
            a, b = linear.lora.A.main_grad, linear.lora.B.main_grad
            if target in ("qkv", "fc1"):
                spread = max(spread, max((p - a).abs().max().item() for p in gather(a, groups.tp_group)))
                grads[f"{layer}.{target}"] = (a, column_unshard(gather(b, groups.tp_group), target))
            else:
                spread = max(spread, max((p - b).abs().max().item() for p in gather(b, groups.tp_group)))
                grads[f"{layer}.{target}"] = (torch.cat(gather(a, groups.tp_group), dim=1), b)
        with torch.no_grad():
            for chunk, weights in zip(chunks, merged, strict=True):
                params = dict(chunk.named_parameters())
                for key, weight in weights.items():
                    params[key].copy_(weight)
                    params[key.replace(".weight", ".lora.B")].zero_()
        merged_loss = loss_and_grads(ddp, groups, ids, train=False)
        row = {"model": name, "tp": tp, "pp": pp, "sp": sp, "layers": sorted({k.split(".")[0] for k in grads}),
               "replica_spread": spread}
        if (tp, pp) == (1, 1):
            reference[name] = (loss, grads)
            row |= {"loss": loss, "merged": merged_loss, "grad_max": max(
                max(a.abs().max().item(), b.abs().max().item()) for a, b in grads.values())}
        else:
            ref_loss, ref_grads = reference[name]
            row["grad_diff"] = max(max((a - ref_grads[k][0]).abs().max().item(),
                                       (b - ref_grads[k][1]).abs().max().item()) for k, (a, b) in grads.items())
            if loss is not None:
                row |= {"loss_diff": abs(loss - ref_loss), "merged_diff": abs(merged_loss - ref_loss)}
        results.append(row)
        destroy_model_parallel()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

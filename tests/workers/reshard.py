"""Multi-rank worker for test_reshard.py: Megatron shards -> engine layout, checked against HF.

torchrun --nproc-per-node 4 tests/workers/reshard.py OUT_DIR MODEL_DIR...
For every model, trainer layout (TP, PP, DP over 4 ranks) and rollout TP R in {1, 2, 4}, loads the
HF weights into Megatron, refits into fresh engine tensors (filled with NaN so an unwritten byte
shows), compares every engine tensor with an independent reference computed from the full HF
tensors, doubles the trainer weights, refits again and checks the pool was reused; then the
same in in-engine mode (this side sends and lands remote bytes, the engine's HandoverState copies the rest,
round by round when the landing buffer holds one bucket, at once when it holds all), whose result the
hand-over checksums (megarl.reshard.verify) must confirm, and whose corruption they must name. Plans put
2 GPUs on a node, so that with PP2 in the tp-dp-pp order each stage has its nodes: bytes of the other stage
cross into a node once and are relayed inside it. Last, engines on ranks of their own (async_rl separate): a
trainer mesh on the first ranks, read from HF through the mapping, refits into engines on the others, which must
equal the same reference, verified, each having received exactly its engine rank's bytes.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
from engine_reference import EngineModel, check_engines_apart, load_hf, reference_engine  # noqa: E402

from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.models.gpt import BuildOptions, build_model, canonical_params, load_hf_weights  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.reshard.aliasing import aliased_views  # noqa: E402
from megarl.reshard.executor import Resharder, engine_tensor_allocations  # noqa: E402
from megarl.reshard.handover import HandoverState, apply_message  # noqa: E402
from megarl.reshard.planner import make_plan  # noqa: E402
from megarl.reshard.verify import mismatched, tensor_checksum  # noqa: E402


def check_layout(model_dir: str, hf: dict, cfg: dict, dims: ParallelDims, dtype: torch.dtype) -> list[dict]:
    """Every rollout TP of one trainer layout; ``dtype`` is the training dtype (the engine's too)."""
    spec, rank = load_spec(model_dir), dist.get_rank()
    groups = init_model_parallel(dims)
    model_parallel_seed(1)
    opts = BuildOptions(dtype=dtype)
    chunks = build_model(spec, groups, opts)
    load_hf_weights(chunks, spec, model_dir, groups, opts)
    src = {n: p.data for n, p in canonical_params(chunks, spec, groups).items()}
    results = []
    for R in (1, 2, 4):
        plan = make_plan(spec, dims, R, gpus_per_node=2, element_size=dtype.itemsize, bucket_bytes=48 * 1024)
        dst = engine_tensor_allocations(plan, rank, dtype, torch.device("cpu"))
        for t in dst.values():
            t.fill_(float("nan"))
        resharder = Resharder(plan, rank, src, dst)
        resharder.refit()
        ref = {n: t.to(dtype) for n, t in reference_engine(hf, cfg, R, plan.engine_rank(rank)).items()}
        exact = sorted(ref) == sorted(dst) and all(torch.equal(dst[n], ref[n]) for n in ref)
        pool = [resharder.pool.buffer(i).data_ptr() for i in range(4)] if resharder.pool else []
        for t in src.values():
            t.mul_(2)
        resharder.refit()
        pool_again = [resharder.pool.buffer(i).data_ptr() for i in range(4)] if resharder.pool else []
        doubled = all(torch.equal(dst[n], ref[n] * 2) for n in ref)
        for t in src.values():
            t.div_(2)
        # In-engine mode: this side sends and lands remote bytes, the "engine" copies the rest, through the wire
        # format and messages an engine gets. A landing buffer of one bucket makes the most rounds; 0 holds all.
        in_engine, rounds, landing, starts = True, {}, {}, {}
        for limit in (plan.bucket_bytes, 0):
            engine_side = Resharder(plan, rank, src, None, in_engine=True, landing_bytes=limit)
            starts[limit] = {start for start, _ in engine_side.rounds}
            params = engine_tensor_allocations(plan, rank, dtype, torch.device("cpu"))
            for t in params.values():
                t.fill_(float("nan"))
            state, model = HandoverState(), EngineModel(params)
            state.handle(model, engine_side.engine_copy().to_wire("actor"))
            for r in range(engine_side.num_rounds):
                engine_side.refit(r)
                state.handle(model, apply_message("actor", torch.zeros(1), r))
            in_engine &= all(torch.equal(params[n], ref[n]) for n in ref)
            rounds[limit], landing[limit] = engine_side.num_rounds, engine_side.landing_bytes + engine_side.pool_bytes
        # Aliased hand-over (rollout.alias_weights): the engine's parameters that are one run of a trainer tensor on
        # this GPU are views of it; the copy writes only the rest, and an update of the trainer is the engine's.
        views = aliased_views(plan, rank, src)
        aliased_side = Resharder(plan, rank, src, None, in_engine=True, aliased=set(views))
        mapped = engine_tensor_allocations(plan, rank, dtype, torch.device("cpu"))
        for t in mapped.values():
            t.fill_(float("nan"))
        mapped |= views
        engine_state, mapped_model = HandoverState(), EngineModel(mapped)
        aliased_copy = aliased_side.engine_copy()
        copied = {aliased_copy.dst_names[int(i)] for i in aliased_copy.table[:, 3]}
        engine_state.handle(mapped_model, aliased_copy.to_wire("actor"))
        for r in range(aliased_side.num_rounds):
            aliased_side.refit(r)
            engine_state.handle(mapped_model, apply_message("actor", torch.zeros(1), r))
        aliased_exact = all(torch.equal(mapped[n], ref[n]) for n in ref)
        expected = aliased_side.expected_checksums()  # collective: on every rank
        reported = [tensor_checksum(mapped[n]) for n in aliased_side.dst_names]
        aliased_checked = torch.equal(torch.stack(reported), expected) if reported else len(expected) == 0
        for t in src.values():
            t.mul_(2)
        aliased_follow = all(torch.equal(mapped[n], ref[n] * 2) for n in views)
        for t in src.values():
            t.div_(2)
        # Verified hand-over: the engine's checksums against the trainer's (summed over the world), then one
        # corrupted bit in one tensor of this rank's engine rank.
        names = engine_side.dst_names
        expected = engine_side.expected_checksums()
        verified = torch.equal(torch.stack([tensor_checksum(params[n]) for n in names]), expected)
        victim = params[names[rank % len(names)]]
        victim.view(-1).view({2: torch.int16, 4: torch.int32}[victim.element_size()])[-1] ^= 1
        caught = mismatched(names, expected, torch.stack([tensor_checksum(params[n]) for n in names]))
        # Relays (pipeline stages on different nodes of 2 GPUs): how many, and how many forward at a round's start
        # what the round before landed.
        relayed = [k for k, bucket in enumerate(plan.buckets) for t in bucket if t.via >= 0]
        results.append({"model": Path(model_dir).name, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "ep": dims.ep,
                        "R": R,
                        "dtype": str(dtype), "in_engine": in_engine, "rank": rank, "exact": exact,
                        "verified": verified, "corruption_caught": caught == [names[rank % len(names)]],
                        "second_refit": doubled, "pool_reused": pool == pool_again, "buckets": len(plan.buckets),
                        "pool_bytes": resharder.pool_bytes, "bucket_bytes": plan.bucket_bytes,
                        "in_engine_rounds": rounds[plan.bucket_bytes],
                        "in_engine_extra_bytes": landing[plan.bucket_bytes],
                        "unbounded_rounds": rounds[0], "unbounded_extra_bytes": landing[0], "relayed": len(relayed),
                        "relayed_at_round_start": sum(k in starts[plan.bucket_bytes] for k in relayed),
                        "aliased": sorted(views), "aliased_exact": aliased_exact, "aliased_checked": aliased_checked,
                        "aliased_follow": aliased_follow, "aliased_copied": sorted(copied & set(views)),
                        "aliased_verified": set(views) <= set(aliased_side.dst_names)})
    destroy_model_parallel()
    return results


def check_separate(model_dir: str, hf: dict, cfg: dict, dims: ParallelDims, dtype: torch.dtype) -> list[dict]:
    """Engines on the ranks after the trainer's ``dims``: every rollout TP that divides them."""
    spec, rank, world = load_spec(model_dir), dist.get_rank(), dist.get_world_size()
    engine_gpus = world - dims.world_size
    return [{"model": Path(model_dir).name, "separate": True, "tp": dims.tp, "pp": dims.pp, "dp": dims.dp}
            | check_engines_apart(make_plan(spec, dims, R, gpus_per_node=2, element_size=dtype.itemsize,
                                            bucket_bytes=48 * 1024, engine_gpus=engine_gpus), rank, hf, cfg, dtype)
            for R in (1, 2, 4) if engine_gpus % R == 0]


def check_regrouped(model_dir: str, hf: dict, cfg: dict) -> list[dict]:
    """A hand-over group whose ranks are not the world's: one trainer rank and two engine ranks on world ranks 1-3
    (group ranks 0-2), as engine workers outside a trainer's world would join it. World rank 0 stays out."""
    group = dist.new_group([1, 2, 3])  # collective over the world: every rank creates it
    if dist.get_rank() == 0:
        return []
    dtype = torch.bfloat16
    plan = make_plan(load_spec(model_dir), ParallelDims(tp=1, pp=1, dp=1), 1, gpus_per_node=2,
                     element_size=dtype.itemsize, bucket_bytes=48 * 1024, engine_gpus=2)
    return [{"model": Path(model_dir).name, "regrouped": True}
            | check_engines_apart(plan, dist.get_rank() - 1, hf, cfg, dtype, group)]


def main() -> None:
    out_dir, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    init_distributed(platform)
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for model_dir in model_dirs:
        spec = load_spec(model_dir)
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hf = load_hf(model_dir)
        for tp in (1, 2, 4):
            for pp in (1, 2):
                if spec.num_kv_heads % tp or world % (tp * pp):
                    continue
                results += check_layout(model_dir, hf, cfg, ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)),
                                        torch.float32)
        if spec.is_moe:  # experts split over expert-parallel ranks (out of DP), with TP or PP beside them
            for tp, pp, ep in ((1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)):
                results += check_layout(model_dir, hf, cfg, ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp), ep=ep),
                                        torch.float32)
        # 16-bit training: every trainer tensor (norm weights included) is in the training dtype.
        results += check_layout(model_dir, hf, cfg, ParallelDims(tp=2, pp=2, dp=world // 4), torch.bfloat16)
        if not spec.is_moe:
            for tp, pp, dp in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)):
                results += check_separate(model_dir, hf, cfg, ParallelDims(tp=tp, pp=pp, dp=dp), torch.bfloat16)
            if world == 4:
                results += check_regrouped(model_dir, hf, cfg)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

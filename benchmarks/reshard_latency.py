"""Refit latency: megarl's zero-redundancy resharder against the all-gather way, and the bandwidth bound.

  torchrun --nproc-per-node W benchmarks/reshard_latency.py --model PRESET_OR_HF_DIR \
      --train-tp N --train-pp M --rollout-tp R [--in-engine [--landing-mb MB]] [--dump DIR] [--json OUT]
      [--plot OUT.png] [--no-relay] [--engine-gpus E]

Trainer shards hold the model in Megatron's layout (from the HF weights when --model is a
directory, random otherwise); engine tensors are the engines' per-rank layout. Both sides share
the GPUs (colocation), or with --engine-gpus E the engines have the last E of the world's GPUs
(async_rl separate). Per refit the slowest rank's time counts. The baseline does what verl and
slime do: per tensor, all-gather over TP, broadcast over PP, convert to full HF tensors, then
slice every engine rank's part out of the full tensor; to engines of their own, trainer rank 0
broadcasts every full tensor to them. --plan-only prints the plan for a world size without
running anything (e.g. 8 GPUs when fewer are at hand; the trainer's GPUs, with --engine-gpus).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import percentile, slowest, sync, time_ms  # noqa: E402

from megarl.distributed.parallel import ParallelDims  # noqa: E402
from megarl.errors import UserError  # noqa: E402
from megarl.models.mapping import REPLICATED, hf_shapes, param_rules, pipeline_stage, to_hf  # noqa: E402
from megarl.models.presets import preset_or_hf_spec  # noqa: E402
from megarl.reshard.engine_layout import engine_tensors  # noqa: E402
from megarl.reshard.planner import LinkModel, Plan, make_plan  # noqa: E402
from megarl.reshard.predict import predict_ms  # noqa: E402
from megarl.run.command import run_main  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset (tiny, llama3-8b, qwen2-7b, llama3-70b) or HF dir")
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--num-layers", type=int, help="keep only the first layers (large models on few GPUs)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nvlink-gbps", type=float, default=LinkModel().nvlink_gbps,
                   help="GB/s each direction inside a node, for the predicted time (parallel.nvlink_gbps)")
    p.add_argument("--network-gbps", type=float, default=LinkModel().network_gbps,
                   help="GB/s each direction per GPU across nodes, for the predicted time (parallel.network_gbps)")
    p.add_argument("--rank-order", default="tp-dp-pp", choices=["tp-dp-pp", "tp-pp-dp"],
                   help="trainer mesh axes from fastest- to slowest-varying rank (parallel.rank_order)")
    p.add_argument("--no-relay", action="store_true",
                   help="every GPU gets the bytes its node lacks from another node (the plan before relays)")
    p.add_argument("--iters", type=int, default=20, help="timed warm refits (at least 10)")
    p.add_argument("--baseline-iters", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--plan-only", type=int, metavar="WORLD", help="print the plan for WORLD GPUs and exit")
    p.add_argument("--engine-gpus", type=int, default=0, metavar="E",
                   help="engines on E GPUs of their own after the trainer's (0: colocated on the trainer's)")
    p.add_argument("--verify", action="store_true",
                   help="also time the hand-over check (rollout.verify_every): trainer and engine checksums")
    p.add_argument("--in-engine", action="store_true",
                   help="also time the in-engine hand-over (SGLang's): round by round into an engine-side copy in "
                        "this process, with its peak extra memory")
    p.add_argument("--landing-mb", type=int, help="in-engine landing buffer (default: two buckets; 0: no limit)")
    p.add_argument("--dump", help="write each rollout rank's engine tensors to DIR/rank{g}.safetensors")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG plot of the results")
    args = p.parse_args(argv)
    if args.iters < 10:
        raise UserError(f"--iters {args.iters}: at least 10 warm refits are needed for p50/p99.")
    if args.engine_gpus < 0 or args.engine_gpus % args.rollout_tp:
        raise UserError(f"--engine-gpus {args.engine_gpus} must be a multiple of --rollout-tp {args.rollout_tp} "
                        "(0: the engines share the trainer's GPUs).")
    if args.engine_gpus and (args.in_engine or args.dump):
        raise UserError("--engine-gpus runs the direct refit only: drop --in-engine and --dump.")
    return args


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def plan_report(plan: Plan, links: LinkModel) -> dict:
    """The plan's byte counts, its predicted time and bound over ``links`` (megarl.reshard.predict.predict_ms)
    and ``engine_ranks``: the engine TP rank each GPU holds, in GPU order."""
    return plan.stats() | predict_ms(plan, links) | {"engine_ranks": plan.engine_ranks}


def trainer_shards(spec, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device, hf_dir: str | None):
    """This rank's Megatron-layout tensors: from HF safetensors (only its slices) or random."""
    dims = plan.dims
    coords = dims.coords(rank)
    names = {t.src_name for b in plan.buckets for t in b if t.src_rank == rank}
    rules = {r.mcore: r for r in param_rules(spec)}
    stage_names = [n for n in plan.src_shapes if pipeline_stage(n, spec, dims.pp) == coords["pp"]]
    reader = None
    if hf_dir is not None:
        from megarl.models.hf_io import HFReader
        from megarl.models.mapping import hf_shapes, to_mcore_shard

        reader = HFReader(hf_dir, spec, hf_shapes(spec))
    out = {}
    for name in sorted(set(stage_names) | names):
        if reader is not None:
            out[name] = to_mcore_shard(rules[name], spec, reader.read, coords["tp"], dims.tp,
                                       plan.padded_vocab).to(device=device, dtype=dtype).contiguous()
        else:
            # Same values on every replica of a shard (DP replicas; TP ranks for norms), as in training.
            shard = "all" if rules[name].kind == REPLICATED else coords["tp"]
            g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}/{shard}".encode()))
            out[name] = torch.randn(plan.src_shapes[name], generator=g, device=device, dtype=torch.float32).to(dtype)
    return out


class NaiveRefit:
    """The verl/slime way: per tensor TP all-gather, PP broadcast, HF conversion, engine-style slicing."""

    def __init__(self, spec, plan: Plan, rank: int, src: dict, dst: dict, device: torch.device):
        self.spec, self.plan, self.rank, self.src, self.dst, self.device = spec, plan, rank, src, dst, device
        dims = plan.dims
        self.trainer = rank < dims.world_size
        self.coords = dims.coords(rank) if self.trainer else {}
        # Engines of their own: trainer rank 0 broadcasts every full tensor to them (a group every rank creates).
        self.to_engines = dist.new_group([0, *range(dims.world_size, plan.num_gpus)]) if plan.separate else None
        self.tp_group = self.pp_group = None
        self.pp_ranks: list[int] = []
        for dp in range(dims.dp):
            for pp in range(dims.pp):
                ranks = [dims.rank(tp=t, dp=dp, pp=pp) for t in range(dims.tp)]
                group = dist.new_group(ranks) if dims.tp > 1 else None
                if rank in ranks:
                    self.tp_group = group
            for t in range(dims.tp):
                ranks = [dims.rank(tp=t, dp=dp, pp=pp) for pp in range(dims.pp)]
                group = dist.new_group(ranks) if dims.pp > 1 else None
                if rank in ranks:
                    self.pp_group, self.pp_ranks = group, ranks
        self.engine = engine_tensors(spec, plan.rollout_tp, plan.engine_rank(rank)) if plan.engine_rank(rank) >= 0 \
            else []
        self.rules = param_rules(spec)
        self.shapes = hf_shapes(spec)
        self.dtype = next(iter((src or dst).values())).dtype

    @torch.no_grad()
    def refit(self) -> None:
        hf_full: dict[str, torch.Tensor] = {}
        wanted = {p.hf for t in self.engine for p in t.pieces}
        for rule in self.rules:
            if self.trainer:
                for name, full in self._gather(rule).items():
                    if self.to_engines is not None and self.rank == 0:
                        dist.broadcast(full, src=0, group=self.to_engines)
                    if name in wanted:
                        hf_full[name] = full
            else:
                for name in rule.hf:
                    full = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
                    dist.broadcast(full, src=0, group=self.to_engines)
                    hf_full[name] = full
            # Engine-style loading: each engine tensor takes its slices of the full HF tensors.
            for tensor in self.engine:
                if all(p.hf in hf_full for p in tensor.pieces) and any(p.hf in rule.hf for p in tensor.pieces):
                    for p in tensor.pieces:
                        self.dst[tensor.name].narrow(p.dim, p.offset, p.length).copy_(
                            hf_full[p.hf].narrow(p.dim, p.start, p.length))
            for name in rule.hf:
                hf_full.pop(name, None)
        sync(self.device)

    def _gather(self, rule) -> dict[str, torch.Tensor]:
        """The full HF tensors of ``rule`` on this trainer rank: PP broadcast, TP all-gather, conversion."""
        dims = self.plan.dims
        stage = pipeline_stage(rule.mcore, self.spec, dims.pp)
        shape = self.plan.src_shapes[rule.mcore]
        local = (self.src[rule.mcore] if self.coords["pp"] == stage
                 else torch.empty(shape, dtype=self.dtype, device=self.device))
        if dims.pp > 1:
            dist.broadcast(local, src=self.pp_ranks[stage], group=self.pp_group)
        shards = [local]
        if dims.tp > 1:
            shards = [torch.empty_like(local) for _ in range(dims.tp)]
            dist.all_gather(shards, local, group=self.tp_group)
        return to_hf(rule, self.spec, shards, self.shapes)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 2**30) -> float:
    """Device copy bandwidth in GB/s, counting bytes read plus written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = [time_ms(lambda: b.copy_(a), device, barrier=False) for _ in range(10)]
    return 2 * nbytes / (percentile(times, 50) / 1e3) / 1e9


def measure_link_bandwidth(device: torch.device, world: int, rank: int, nbytes: int = 2**28) -> float:
    """One-direction P2P GB/s between rank pairs (0<->1, 2<->3, ...), slowest pair."""
    if world < 2:
        return 0.0
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    peer = rank ^ 1
    def exchange():
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend if rank % 2 == 0 else dist.irecv, buf, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    exchange()
    t = percentile([time_ms(exchange, device) for _ in range(5)], 50)
    return slowest([-(nbytes / (t / 1e3) / 1e9)], device)[0] * -1


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    links = LinkModel(nvlink_gbps=args.nvlink_gbps, network_gbps=args.network_gbps)
    spec = preset_or_hf_spec(args.model, args.num_layers)
    hf_dir = args.model if Path(args.model).is_dir() else None
    dtype = DTYPES[args.dtype]
    es = torch.finfo(dtype).bits // 8
    if args.plan_only:
        world = args.plan_only
        if world % (args.train_tp * args.train_pp):
            raise UserError(f"--train-tp x --train-pp must divide the world size {world}.")
        dims = ParallelDims(tp=args.train_tp, pp=args.train_pp, dp=world // (args.train_tp * args.train_pp),
                            order=args.rank_order)
        t0 = time.perf_counter()
        plan = make_plan(spec, dims, args.rollout_tp, gpus_per_node=args.gpus_per_node, element_size=es,
                         bucket_bytes=args.bucket_mb * 2**20, relay=not args.no_relay, links=links,
                         engine_gpus=args.engine_gpus)
        report = plan_report(plan, links) | {"plan_ms": (time.perf_counter() - t0) * 1e3, "world": world,
                                             "engine_gpus": args.engine_gpus}
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainers = world - args.engine_gpus
    if trainers < 1 or trainers % (args.train_tp * args.train_pp):
        raise UserError(f"--train-tp {args.train_tp} x --train-pp {args.train_pp} must divide the trainer's GPUs: "
                        f"the world size {world} (torchrun --nproc-per-node) less --engine-gpus {args.engine_gpus}.")
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank = dist.get_rank()
    dims = ParallelDims(tp=args.train_tp, pp=args.train_pp, dp=trainers // (args.train_tp * args.train_pp),
                        order=args.rank_order)

    t0 = time.perf_counter()
    plan = make_plan(spec, dims, args.rollout_tp, gpus_per_node=min(args.gpus_per_node, world), element_size=es,
                     bucket_bytes=args.bucket_mb * 2**20, relay=not args.no_relay, links=links,
                     engine_gpus=args.engine_gpus)
    plan_ms = (time.perf_counter() - t0) * 1e3
    from megarl.reshard.executor import Resharder, engine_tensor_allocations

    src = trainer_shards(spec, plan, rank, dtype, device, hf_dir) if rank < dims.world_size else {}
    dst = engine_tensor_allocations(plan, rank, dtype, device)
    sync(device)
    base_mem = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    resharder = Resharder(plan, rank, src, dst, device=device)
    setup_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        resharder.refit()
    times = slowest([time_ms(resharder.refit, device) for _ in range(args.iters)], device)
    phase_runs = [resharder.refit_phases() for _ in range(3)]
    phases = {k: percentile(slowest([run[k] for run in phase_runs], device), 50) for k in phase_runs[0]}
    peak_extra = (torch.cuda.max_memory_allocated(device) - base_mem) if cuda else resharder.pool_bytes
    ours = [v.clone() for v in dst.values()] if not args.no_baseline else []

    baseline_times: list[float] = []
    match = None
    if not args.no_baseline:
        naive = NaiveRefit(spec, plan, rank, src, dst, device)
        for v in dst.values():
            v.zero_()
        naive.refit()
        baseline_times = slowest([time_ms(naive.refit, device) for _ in range(args.baseline_iters)], device)
        bad = [n for a, (n, b) in zip(ours, dst.items(), strict=True) if not torch.equal(a, b)]
        if bad and os.environ.get("MEGARL_DEBUG") == "1":
            print(f"rank {rank}: baseline differs in {bad[:5]}", flush=True)
        match_t = torch.tensor([float(not bad)],
                               device=device)
        dist.all_reduce(match_t, op=dist.ReduceOp.MIN)
        match = bool(match_t.item())
        resharder.refit()

    verify: dict = {}
    if args.verify:
        from megarl.reshard.verify import tensor_checksum

        runs = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            expected = resharder.expected_checksums()
            sync(device)
            t1 = time.perf_counter()
            reported = torch.stack([tensor_checksum(dst[n]) for n in resharder.dst_names]) if resharder.dst_names \
                else expected  # a trainer GPU of engines of their own: no engine rank to check
            sync(device)
            runs.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
        ok = torch.tensor([float(torch.equal(expected, reported))], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        verify = {"verify_trainer_ms": percentile([r[0] for r in runs], 50),
                  "verify_engine_ms": percentile([r[1] for r in runs], 50), "verify_matches": bool(ok.item())}

    in_engine = measure_in_engine(plan, rank, src, dst, device, args) if args.in_engine else {}
    copy_gbps = measure_copy_bandwidth(device) if cuda else 0.0
    link_gbps = measure_link_bandwidth(device, world, rank) if cuda else 0.0
    stats = plan.stats()
    local_bytes_gpu = max(sum(t.nbytes for b in plan.buckets for t in b if t.local and t.dst_rank == g)
                          for g in range(world))
    bound_ms = 0.0
    if cuda:
        bound_ms = 2 * local_bytes_gpu / (copy_gbps * 1e9) * 1e3
        if stats["max_recv_bytes_per_gpu"] and link_gbps:
            bound_ms = max(bound_ms, stats["max_recv_bytes_per_gpu"] / (link_gbps * 1e9) * 1e3)
    engine_bytes = stats["engine_bytes_per_gpu"]
    p50, p99 = percentile(times, 50), percentile(times, 99)
    result = {
        "model": args.model, "num_layers": spec.num_layers, "dtype": args.dtype, "world": world,
        "engine_gpus": args.engine_gpus,
        "train_tp": dims.tp, "train_pp": dims.pp, "train_dp": dims.dp, "rollout_tp": args.rollout_tp,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "plan_ms": plan_ms, "setup_ms": setup_ms, "refit_ms": times, "phases_serialized_ms": phases,
        "p50_ms": p50, "p99_ms": p99,
        "engine_bytes_per_gpu": engine_bytes, "cross_gpu_bytes_per_gpu": stats["max_recv_bytes_per_gpu"],
        "effective_GBps": engine_bytes / (p50 / 1e3) / 1e9, "copy_GBps": copy_gbps, "link_GBps": link_gbps,
        "bound_ms": bound_ms, "vs_bound": p50 / bound_ms if bound_ms else None,
        "peak_extra_bytes": peak_extra, "pool_bytes": resharder.pool_bytes,
        "baseline_ms": baseline_times, "baseline_p50_ms": percentile(baseline_times, 50) if baseline_times else None,
        "speedup": percentile(baseline_times, 50) / p50 if baseline_times else None,
        "baseline_matches": match, "plan": plan_report(plan, links), "num_buckets": len(plan.buckets),
    } | verify | in_engine
    if args.dump:
        from safetensors.torch import save_file

        Path(args.dump).mkdir(parents=True, exist_ok=True)
        tmp = Path(args.dump) / f".rank{rank}.safetensors.tmp"
        save_file({k: v.cpu().contiguous() for k, v in dst.items()}, str(tmp))
        os.replace(tmp, Path(args.dump) / f"rank{rank}.safetensors")
    if rank == 0:
        print_table(result)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
        if args.plot:
            plot(result, args.plot)
    dist.destroy_process_group()


def measure_in_engine(plan, rank: int, src: dict, dst: dict, device: torch.device, args) -> dict:
    """The in-engine hand-over with the engine's side (megarl.reshard.handover) in this process: per round, this
    side's refit, then the engine rank's copy into its parameters. Exact against ``dst`` (the direct refit's)."""
    from megarl.reshard.executor import Resharder, engine_tensor_allocations
    from megarl.reshard.handover import EngineApplier

    cuda = device.type == "cuda"
    params = engine_tensor_allocations(plan, rank, dst[next(iter(dst))].dtype, device)
    sync(device)
    base_mem = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    landing = None if args.landing_mb is None else args.landing_mb * 2**20
    resharder = Resharder(plan, rank, src, None, device=device, in_engine=True, landing_bytes=landing)
    applier = EngineApplier(resharder.engine_copy(), params)

    def handover() -> None:
        for r in range(resharder.num_rounds):
            resharder.refit(r)
            sync(device)  # what an engine call waits for
            applier.run(r)

    for _ in range(3):
        handover()
    times = slowest([time_ms(handover, device) for _ in range(args.iters)], device)
    peak = (torch.cuda.max_memory_allocated(device) - base_mem) if cuda else resharder.pool_bytes
    ok = torch.tensor([float(all(torch.equal(params[n], dst[n]) for n in dst))], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"in_engine_p50_ms": percentile(times, 50), "in_engine_rounds": resharder.num_rounds,
            "in_engine_landing_bytes": resharder.landing_bytes, "in_engine_pool_bytes": resharder.pool_bytes,
            "in_engine_peak_extra_bytes": peak + (0 if cuda else resharder.landing_bytes),
            "in_engine_matches": bool(ok.item())}


def print_table(r: dict) -> None:
    rows = [
        ("model", f"{r['model']} ({r['num_layers']} layers, {r['dtype']})"),
        ("layout", f"train TP{r['train_tp']} PP{r['train_pp']} DP{r['train_dp']} -> rollout TP{r['rollout_tp']} "
                   f"on {r['world']} x {r['device']}" + (f", the engines on {r['engine_gpus']} of their own"
                                                         if r["engine_gpus"] else ", colocated")),
        ("refit p50 / p99", f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f} ms over {len(r['refit_ms'])} warm refits"),
        ("phases, serialized", ", ".join(f"{k} {v:.2f}" for k, v in r["phases_serialized_ms"].items()) + " ms"),
        ("plan / setup (once)", f"{r['plan_ms']:.1f} / {r['setup_ms']:.1f} ms, {r['num_buckets']} buckets"),
        ("engine bytes per GPU", gib(r["engine_bytes_per_gpu"])),
        ("bytes crossing GPUs per GPU", gib(r["cross_gpu_bytes_per_gpu"])),
        ("effective bandwidth", f"{r['effective_GBps']:.0f} GB/s (copy {r['copy_GBps']:.0f} GB/s, "
                                f"link {r['link_GBps']:.0f} GB/s)"),
        ("bandwidth bound", f"{r['bound_ms']:.2f} ms" + (f" (refit = {r['vs_bound']:.2f} x bound)"
                                                       if r["vs_bound"] else "")),
        ("peak extra memory", f"{gib(r['peak_extra_bytes'])} (pool {gib(r['pool_bytes'])})"),
    ]
    if "verify_matches" in r:
        rows.append(("hand-over check (verify_every)", f"trainer {r['verify_trainer_ms']:.1f} ms + engine "
                     f"{r['verify_engine_ms']:.1f} ms, checksums {'match' if r['verify_matches'] else 'DIFFER'}"))
    if "in_engine_p50_ms" in r:
        rows.append(("in-engine hand-over p50", f"{r['in_engine_p50_ms']:.2f} ms in {r['in_engine_rounds']} rounds "
                     f"(an engine call each in a real engine), peak extra memory "
                     f"{gib(r['in_engine_peak_extra_bytes'])} (landing {gib(r['in_engine_landing_bytes'])}), "
                     f"same result: {r['in_engine_matches']}"))
    if r["baseline_p50_ms"] is not None:
        name = "naive all-gather" + (" + broadcast" if r["engine_gpus"] else "") + " p50"
        rows.append((name, f"{r['baseline_p50_ms']:.1f} ms -> speedup {r['speedup']:.1f}x, "
                           f"same result: {r['baseline_matches']}"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["megarl p50", "bandwidth bound"] + (["naive p50"] if r["baseline_p50_ms"] else [])
    values = [r["p50_ms"], r["bound_ms"]] + ([r["baseline_p50_ms"]] if r["baseline_p50_ms"] else [])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh(labels, values, color=["#2a7", "#888", "#c44"][: len(values)])
    ax.set_xscale("log")
    ax.set_xlabel("refit time (ms, log scale)")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.1f} ms", va="center")
    ax.set_title(f"{r['model']}: TP{r['train_tp']}xPP{r['train_pp']} -> R{r['rollout_tp']} on {r['world']} GPU(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run_main(main)

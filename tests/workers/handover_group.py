"""Worker for test_reshard.py: engine workers outside the trainer's world receive their bytes through the
hand-over group (megarl.reshard.handover_group).

python tests/workers/handover_group.py OUT_DIR MODEL_DIR ROLE INDEX TRAINERS ENGINES WORLD_PORT GROUP_PORT TIMEOUT_S
ROLE trainer: rank INDEX of a gloo world of TRAINERS processes of its own (as torchrun makes one), a TP mesh over
them; ROLE engine: engine GPU INDEX, in no world. Every process joins the hand-over group (the trainers as ranks
0..TRAINERS-1, engine GPU i as TRAINERS + i), then, for every rollout TP dividing ENGINES, refits directly and
in-engine, checks the result against HF slicing and the checksums over the group, and writes OUT_DIR/ROLE_INDEX.json
(or the error it met, for a member that never comes).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_reference import EngineModel, reference_engine, trainer_shards
from safetensors.torch import load_file

from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.spec import load_spec
from megarl.reshard.executor import Resharder, engine_tensor_allocations
from megarl.reshard.handover import HandoverState, apply_message
from megarl.reshard.handover_group import handover_group
from megarl.reshard.planner import make_plan
from megarl.reshard.verify import tensor_checksum


class Reports:
    """An engine rank's checksums of its parameters, as the engine reports them (megarl.reshard.verify)."""

    def __init__(self, names: list[str], params: dict) -> None:
        self.names, self.params = names, params

    def checksums(self, num_tensors: int) -> torch.Tensor:
        assert num_tensors == len(self.names)
        return torch.stack([tensor_checksum(self.params[n]) for n in self.names]) if self.names \
            else torch.zeros(0, 2, dtype=torch.int64)


def refits(model_dir: str, rank: int, trainers: int, engines: int, group) -> list[dict]:
    spec, cpu, dtype = load_spec(model_dir), torch.device("cpu"), torch.bfloat16
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        hf |= load_file(f)
    dims = ParallelDims(tp=trainers, pp=1, dp=1)
    results = []
    for R in (r for r in (1, 2) if engines % r == 0):
        plan = make_plan(spec, dims, R, gpus_per_node=8, element_size=dtype.itemsize, bucket_bytes=48 * 1024,
                         engine_gpus=engines)
        src = trainer_shards(spec, dims, rank, hf, dtype, plan.padded_vocab)
        engine = plan.engine_rank(rank) >= 0
        ref = {n: t.to(dtype) for n, t in reference_engine(hf, cfg, R, plan.engine_rank(rank)).items()} if engine \
            else {}
        dst = engine_tensor_allocations(plan, rank, dtype, cpu) if engine else {}
        for t in dst.values():
            t.fill_(float("nan"))
        Resharder(plan, rank, src, dst, group=group, device=cpu).refit()
        side = Resharder(plan, rank, src, None, group=group, device=cpu, in_engine=True,
                         landing_bytes=plan.bucket_bytes)
        params = engine_tensor_allocations(plan, rank, dtype, cpu) if engine else {}
        state, model = HandoverState(), EngineModel(params)
        if engine:
            state.handle(model, side.engine_copy().to_wire("actor"))
        for r in range(side.num_rounds):
            side.refit(r)
            if engine:
                state.handle(model, apply_message("actor", torch.zeros(1), r))
        expected = side.expected_checksums()  # over the hand-over group
        side.verify(Reports(side.dst_names, params), 0)  # every member's report, gathered over the group
        results.append({
            "R": R, "rank": rank, "engine": engine, "src": len(src),
            "exact": sorted(ref) == sorted(dst) and all(torch.equal(dst[n], ref[n]) for n in ref),
            "in_engine": all(torch.equal(params[n], ref[n]) for n in ref),
            "verified": torch.equal(torch.stack([tensor_checksum(params[n]) for n in side.dst_names]), expected)
            if engine else len(expected) == 0,
            "received": sum(t.nbytes for b in plan.buckets for t in b if t.dst_rank == rank)})
    return results


def main() -> None:
    out_dir, model_dir, role = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    index, trainers, engines, world_port, group_port = map(int, sys.argv[4:9])
    timeout_s = float(sys.argv[9])
    rank = index if role == "trainer" else trainers + index
    if role == "trainer":  # the trainer's own world, which the engines are not in
        store = dist.TCPStore("127.0.0.1", world_port, trainers, is_master=index == 0)
        dist.init_process_group("gloo", store=store, rank=index, world_size=trainers)
    try:
        group = handover_group(rank, trainers + engines, "127.0.0.1", group_port, backend="gloo",
                               timeout_s=timeout_s)
    except UserError as err:
        (out_dir / f"{role}_{index}.json").write_text(json.dumps({"error": str(err)}))
        return
    rows = refits(model_dir, rank, trainers, engines, group)
    if role == "trainer":  # the trainer's world still serves its own collectives
        total = torch.tensor([1])
        dist.all_reduce(total)
        rows = [r | {"world": int(total.item())} for r in rows]
    (out_dir / f"{role}_{index}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()

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
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_reference import check_engines_apart, load_hf

from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.spec import load_spec
from megarl.reshard.handover_group import handover_group
from megarl.reshard.planner import make_plan


def refits(model_dir: str, rank: int, trainers: int, engines: int, group) -> list[dict]:
    spec, dtype, hf = load_spec(model_dir), torch.bfloat16, load_hf(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return [check_engines_apart(make_plan(spec, ParallelDims(tp=trainers, pp=1, dp=1), R, gpus_per_node=8,
                                          element_size=dtype.itemsize, bucket_bytes=48 * 1024, engine_gpus=engines),
                                rank, hf, cfg, dtype, group)
            for R in (1, 2) if engines % R == 0]


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
    # gloo's threads of the groups, left to C++ static destructors, can abort the exit ("terminate called without an
    # active exception", seen in CI): the results are written, so leave without them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""The refit plan: every engine byte exactly once, nearest replica first, into a node once, balanced, bucket-bounded."""

import itertools
import math
from collections import defaultdict

import pytest
import torch

from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.mapping import REPLICATED, hf_shapes, param_rules
from megarl.models.presets import preset_or_hf_spec
from megarl.reshard.engine_layout import engine_tensors
from megarl.reshard.executor import Resharder, allocate_flat_buckets, engine_tensor_allocations
from megarl.reshard.planner import LinkModel, engine_groups, make_plan, unit_bytes
from megarl.reshard.predict import describe_plan, predict_ms
from megarl.rollout.group import EngineGroup

TINY = preset_or_hf_spec("tiny")  # 8 heads, 4 kv heads, vocab 1000 (not a multiple of 64 * R)
LAYOUTS = [(tp, pp, dp, r) for tp, pp, dp, r in itertools.product((1, 2, 4), (1, 2), (1, 2), (1, 2, 4, 8))
           if (tp * pp * dp) % r == 0]


def check_exactly_once(plan):
    """Per destination rank and engine tensor, transfers tile exactly the engine pieces."""
    covered = defaultdict(list)
    for bucket in plan.buckets:
        for t in bucket:
            covered[t.dst_rank, t.dst_name].append((t.dst_offset, t.dst_offset + t.length))
    for g in range(plan.num_gpus):
        if plan.engine_rank(g) < 0:
            continue
        for tensor in engine_tensors(plan.spec, plan.rollout_tp, plan.engine_rank(g)):
            want = sorted((p.offset, p.offset + p.length) for p in tensor.pieces)
            got = sorted(covered.pop((g, tensor.name), []))
            merged = []
            for lo, hi in got:
                assert not merged or lo >= merged[-1][1], f"byte written twice: rank {g} {tensor.name}"
                if merged and lo == merged[-1][1]:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            want_merged = []
            for lo, hi in want:
                if want_merged and lo == want_merged[-1][1]:
                    want_merged[-1] = (want_merged[-1][0], hi)
                else:
                    want_merged.append((lo, hi))
            assert merged == want_merged, (g, tensor.name)
    assert not covered, f"transfers to tensors the engine does not have: {list(covered)[:3]}"


@pytest.mark.parametrize("tp,pp,dp,r", LAYOUTS)
def test_plan_writes_every_engine_byte_exactly_once(tp, pp, dp, r):
    plan = make_plan(TINY, ParallelDims(tp=tp, pp=pp, dp=dp), r, gpus_per_node=4, element_size=2,
                     bucket_bytes=64 * 1024)
    check_exactly_once(plan)
    check_relays(plan)
    assert set(bytes_entering_nodes(plan).values()) <= {1}


@pytest.mark.parametrize("tp,pp,dp,r", LAYOUTS)
def test_nothing_crosses_a_link_the_destination_already_holds(tp, pp, dp, r):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    plan = make_plan(TINY, dims, r, gpus_per_node=4, element_size=2, bucket_bytes=64 * 1024)
    replicated = {rule.mcore for rule in param_rules(TINY) if rule.kind == REPLICATED}
    for bucket in plan.buckets:
        send, recv = defaultdict(int), defaultdict(int)
        for t in bucket:
            if t.local:
                continue
            src, dst = dims.coords(t.src_rank), dims.coords(t.dst_rank)
            same_shard = src["pp"] == dst["pp"] and (src["tp"] == dst["tp"] or t.src_name in replicated)
            assert not same_shard, f"{t} moves data rank {t.dst_rank} already holds"
            send[t.sender] += t.nbytes
            recv[t.dst_rank] += t.nbytes
        assert max([*send.values(), *recv.values(), 0]) <= plan.bucket_bytes


def test_same_node_replica_is_preferred():
    # TP2 x DP2, 2 GPUs per node: GPU 0 lacks TP rank 1's slices, held by GPU 1 (same node) and GPU 3.
    plan = make_plan(TINY, ParallelDims(tp=2, pp=1, dp=2), 1, gpus_per_node=2, element_size=2)
    stats = plan.stats()
    assert stats["cross_gpu_bytes"] > 0 and stats["inter_node_bytes"] == 0


def test_sends_are_balanced_over_data_parallel_replicas():
    # One node: GPUs 0 and 2 both need TP rank 1's slices, held by GPUs 1 and 3.
    plan = make_plan(TINY, ParallelDims(tp=2, pp=1, dp=2), 1, gpus_per_node=8, element_size=2)
    sent = defaultdict(int)
    for (src, dst), nbytes in plan.link_bytes().items():
        if src != dst:
            sent[src] += nbytes
    assert min(sent.values()) / max(sent.values()) > 0.9, dict(sent)


def test_llama3_8b_tp4_pp2_to_r2_moves_less_than_all_gather():
    spec = preset_or_hf_spec("llama3-8b")
    plan = make_plan(spec, ParallelDims(tp=4, pp=2, dp=1), 2, element_size=2)
    stats = plan.stats()
    # Each GPU needs half the model (8 GB) in its engine; it receives only what it lacks.
    assert stats["max_recv_bytes_per_gpu"] <= stats["engine_bytes_per_gpu"]
    assert stats["max_recv_bytes_per_gpu"] < stats["naive_gathered_bytes_per_gpu"] / 1.9
    assert stats["local_bytes"] + stats["cross_gpu_bytes"] == 8 * stats["engine_bytes_per_gpu"]


@pytest.mark.parametrize("tp,pp,r", [(1, 2, 1), (1, 2, 2), (2, 1, 1)])
def test_buckets_carry_both_directions_of_the_link(tp, pp, r):
    """On two GPUs each GPU lacks bytes the other holds. Buckets in layer order ran one direction at a time
    under PP (PP2 -> R1: none of 73 buckets used both); filled first-fit, every bucket but possibly the
    last carries both, and the bucket count nears the bytes over the budget."""
    spec = preset_or_hf_spec("llama3-8b")
    plan = make_plan(spec, ParallelDims(tp=tp, pp=pp, dp=1), r, element_size=2)
    directions = [{(t.src_rank, t.dst_rank) for t in b if not t.local} for b in plan.buckets]
    assert sum(len(d) == 2 for d in directions) >= len(plan.buckets) - 1, directions
    most = max(plan.stats()["max_recv_bytes_per_gpu"], plan.stats()["max_send_bytes_per_gpu"])
    assert len(plan.buckets) <= math.ceil(most / plan.bucket_bytes) + 1


def test_predicted_time_counts_each_link_direction_and_the_network():
    """The time model: a bucket takes its busiest GPU's link direction or its local copies (overlapped),
    plus a fixed cost; the bound is the busiest direction over the whole refit."""
    spec = preset_or_hf_spec("llama3-8b")
    links = LinkModel(nvlink_gbps=100.0, network_gbps=10.0, hbm_copy_gbps=1000.0, bucket_overhead_ms=0.5)
    plan = make_plan(spec, ParallelDims(tp=2, pp=1, dp=1), 1, element_size=2, gpus_per_node=8)
    per_gpu = plan.stats()["max_recv_bytes_per_gpu"]
    got = predict_ms(plan, links)
    assert got["bound_ms"] == pytest.approx(per_gpu / 100e9 * 1e3)
    assert got["predicted_ms"] >= got["bound_ms"] + 0.5 * len(plan.buckets) - 1e-9
    # The same two GPUs on two nodes: every byte crosses the network, ten times slower.
    apart = make_plan(spec, ParallelDims(tp=2, pp=1, dp=1), 1, element_size=2, gpus_per_node=1)
    assert predict_ms(apart, links)["bound_ms"] == pytest.approx(10 * got["bound_ms"])
    # One GPU: local copies only, read and written at the HBM rate.
    alone = make_plan(spec, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=2)
    local = alone.stats()["local_bytes"]
    assert predict_ms(alone, links)["bound_ms"] == pytest.approx(2 * local / 1000e9 * 1e3)
    # The console line says the rates it assumed, which the config sets (parallel.nvlink_gbps, network_gbps).
    line = describe_plan(apart, links=links)
    assert "network at 10 GB/s" in line and f"predicted {predict_ms(apart, links)['predicted_ms']:.1f} ms" in line


def test_engines_are_placed_where_their_bytes_already_are():
    """TP4 x PP2 -> R2 on one node of 8: engine rank g % 2 left four GPUs holding none of their engine's
    bytes; grouping {0,2}, {1,3}, {4,6}, {5,7} gives every GPU 2 GB locally, and the most any GPU
    receives falls from 8.03 to 6.02 GB."""
    spec = preset_or_hf_spec("llama3-8b")
    plan = make_plan(spec, ParallelDims(tp=4, pp=2, dp=1), 2, element_size=2)
    assert plan.engine_ranks == [0, 0, 1, 1, 0, 0, 1, 1]
    assert plan.engines() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    local = defaultdict(int)
    for b in plan.buckets:
        for t in b:
            if t.local:
                local[t.dst_rank] += t.nbytes
    assert min(local[g] for g in range(8)) > 1.9e9
    assert plan.stats()["max_recv_bytes_per_gpu"] < 6.1e9
    assert predict_ms(plan)["predicted_ms"] < 26


def bytes_entering_nodes(plan):
    """Per (node, engine rank, engine tensor, dim, unit of length): how many times its bytes cross into the node."""
    node = lambda g: g // plan.gpus_per_node  # noqa: E731
    entered = defaultdict(int)
    for bucket in plan.buckets:
        for t in bucket:
            if node(t.sender) != node(t.dst_rank):
                for i in range(t.dst_offset, t.dst_offset + t.length):
                    entered[node(t.dst_rank), plan.engine_rank(t.dst_rank), t.dst_name, t.dim, i] += 1
    return entered


def check_relays(plan):
    """Each relayed transfer sits in the bucket right after its feeder, which brought the same bytes into the
    forwarding GPU: another GPU of the destination's node, of its engine rank. The number of relayed transfers."""
    node = lambda g: g // plan.gpus_per_node  # noqa: E731
    relayed = 0
    for k, bucket in enumerate(plan.buckets):
        before = set(plan.buckets[k - 1]) if k else set()
        for t in bucket:
            if t.via < 0:
                continue
            relayed += 1
            assert not t.local and t.sender == t.via != t.dst_rank, t
            assert node(t.via) == node(t.dst_rank) and plan.engine_rank(t.via) == plan.engine_rank(t.dst_rank), t
            assert t.feeder() in before and t.feeder().via < 0, (k, t)
    return relayed


def check_bucket_bounds(plan):
    for bucket in plan.buckets:
        send, recv = defaultdict(int), defaultdict(int)
        for t in bucket:
            if not t.local:
                send[t.sender] += t.nbytes
                recv[t.dst_rank] += t.nbytes
        assert max([*send.values(), *recv.values(), 0]) <= plan.bucket_bytes


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp"])
def test_a_byte_crosses_into_a_node_once_and_fans_out_inside(order):
    """64 GPUs on 8 nodes, TP4 PP2 DP8 -> R2. With tp-dp-pp a node holds one pipeline stage, and each of its four
    GPUs of an engine rank needs the same bytes of the other stage: relayed, they cross into the node once and
    the GPU they land on forwards them to the other three. With tp-pp-dp every node holds a whole pipeline."""
    dims = ParallelDims(tp=4, pp=2, dp=8, order=order)
    plan = make_plan(TINY, dims, 2, gpus_per_node=8, element_size=2, bucket_bytes=64 * 1024)
    direct = make_plan(TINY, dims, 2, gpus_per_node=8, element_size=2, bucket_bytes=64 * 1024, relay=False)
    for p in (plan, direct):
        check_exactly_once(p)
        check_bucket_bounds(p)
    assert set(bytes_entering_nodes(plan).values()) <= {1}
    relayed = check_relays(plan)
    stats, before = plan.stats(), direct.stats()
    if order == "tp-pp-dp":
        assert relayed == 0 and stats["inter_node_bytes"] == before["inter_node_bytes"] == 0
        return
    assert max(bytes_entering_nodes(direct).values()) == 4
    assert relayed > 0 and 4 * stats["inter_node_bytes"] == before["inter_node_bytes"]
    assert stats["local_bytes"] == before["local_bytes"]
    # Every GPU lands its share: the most any GPU receives from other nodes is near a quarter of before.
    node = lambda g: g // 8  # noqa: E731
    landed = [defaultdict(int), defaultdict(int)]
    for p, into in zip((plan, direct), landed, strict=True):
        for (s, d), n in p.link_bytes().items():
            if node(s) != node(d):
                into[d] += n
    assert max(landed[0].values()) < 0.3 * max(landed[1].values())


def test_relays_cut_the_predicted_time_across_nodes():
    """Llama-3-8B, the 64-GPU tp-dp-pp plan in docs/benchmarks.md: a quarter of the bytes cross the network, and
    the bound and the predicted time fall with them (the network carries the most per GPU)."""
    spec = preset_or_hf_spec("llama3-8b")
    dims = ParallelDims(tp=4, pp=2, dp=8, order="tp-dp-pp")
    plan, direct = make_plan(spec, dims, 2), make_plan(spec, dims, 2, relay=False)
    assert 4 * plan.stats()["inter_node_bytes"] == direct.stats()["inter_node_bytes"]
    check_relays(plan)
    check_bucket_bounds(plan)
    got, before = predict_ms(plan), predict_ms(direct)
    assert got["bound_ms"] < 0.3 * before["bound_ms"]
    assert got["predicted_ms"] < 0.4 * before["predicted_ms"]
    # A bucket moves across nodes, per GPU and direction, what the network carries while NVLink moves a bucket
    # (50 of 365 GB/s): so network time is spread over every bucket instead of holding up a few.
    links = LinkModel()
    share = plan.bucket_bytes * links.network_gbps / links.nvlink_gbps
    busiest = []
    for bucket in plan.buckets:
        network: dict[tuple[int, str], int] = defaultdict(int)
        for t in bucket:
            if t.sender // 8 != t.dst_rank // 8:
                network[t.sender, "out"] += t.nbytes
                network[t.dst_rank, "in"] += t.nbytes
        busiest.append(max(network.values(), default=0))
    assert max(busiest) <= share and sum(b > 0.5 * share for b in busiest) > 0.5 * len(busiest)
    assert got["predicted_ms"] < 2.2 * got["bound_ms"]


@pytest.mark.parametrize("tp,pp,dp,r", LAYOUTS)
def test_every_engine_stays_inside_a_node_with_one_of_each_rank(tp, pp, dp, r):
    plan = make_plan(TINY, ParallelDims(tp=tp, pp=pp, dp=dp), r, gpus_per_node=4, element_size=2)
    engines = plan.engines()
    assert sorted(g for e in engines for g in e) == list(range(tp * pp * dp))
    for members in engines:
        assert [plan.engine_rank(g) for g in members] == list(range(r))
        if r <= 4:
            assert len({g // 4 for g in members}) == 1, members


def test_engine_groups_and_gathers_follow_engine_rank_order():
    """A process group orders its members by global rank; gathers come back in engine-rank order."""
    assert engine_groups([1, 0, 0, 1], 2) == [[1, 0], [2, 3]]
    group = EngineGroup(index=0, num_groups=2, size=2, rank_in_group=1, members=(1, 0), group=None)
    assert group._engine_order(["from rank 0", "from rank 1"]) == ["from rank 1", "from rank 0"]


@pytest.mark.parametrize("r,needle", [(3, "must divide the world size"),
                                      (16, "num_attention_heads=8 is not divisible")])
def test_rollout_tp_that_cannot_map_is_rejected(r, needle):
    with pytest.raises(UserError, match=needle):
        make_plan(TINY, ParallelDims(tp=1, pp=1, dp=16), r)


def test_trainer_tp_that_cannot_map_is_rejected():
    with pytest.raises(UserError, match="TP must divide"):
        make_plan(TINY, ParallelDims(tp=8, pp=1, dp=1), 1)


def _single_rank_setup():
    plan = make_plan(TINY, ParallelDims(tp=1, pp=1, dp=1), 1, element_size=4)
    src = {name: torch.randn(shape) for name, shape in plan.src_shapes.items()}
    return plan, src


def test_model_that_disagrees_with_the_plan_is_rejected_before_any_copy():
    plan, src = _single_rank_setup()
    dst = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    bad = dict(src, **{"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(10, 10)})
    with pytest.raises(UserError, match="linear_fc1.weight"):
        Resharder(plan, 0, bad, dst)
    wrong_dtype = {k: v.to(torch.bfloat16) for k, v in src.items()}
    with pytest.raises(UserError, match="2-byte elements"):
        Resharder(plan, 0, wrong_dtype, dst)
    missing = dict(dst)
    del missing["model.norm.weight"]
    with pytest.raises(UserError, match="model.norm.weight"):
        Resharder(plan, 0, src, missing)


def test_flat_buckets_hand_out_filled_engine_tensors():
    plan, src = _single_rank_setup()
    buckets = allocate_flat_buckets(plan, 0, torch.float32, torch.device("cpu"), max_bytes=1 << 20)
    dst = {name: t for b in buckets for name, t in b.tensors.items()}
    plain = engine_tensor_allocations(plan, 0, torch.float32, torch.device("cpu"))
    Resharder(plan, 0, src, dst).refit()
    Resharder(plan, 0, src, plain).refit()
    assert len(buckets) > 1 and sorted(dst) == sorted(plain)
    for name in plain:
        assert torch.equal(dst[name], plain[name]), name
    for b in buckets:
        for t in b.tensors.values():
            assert t.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()


def moe_spec(tmp_path):
    """Qwen3-MoE's kind, small: 8 experts in each of 4 layers."""
    import json

    from helpers import TINY as HF_TINY
    from megarl.models.spec import load_spec

    config = HF_TINY["qwen3_moe"] | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_spec(tmp_path)


MOE_LAYOUTS = [(tp, pp, dp, ep, r) for tp, pp, dp, ep, r in itertools.product((1, 2), (1, 2), (1, 2, 4), (1, 2, 4),
                                                                              (1, 2, 4))
               if dp % ep == 0 and (tp * pp * dp) % r == 0 and tp * pp * dp <= 8]


@pytest.mark.parametrize("tp,pp,dp,ep,r", MOE_LAYOUTS)
def test_moe_experts_come_from_their_expert_parallel_rank_exactly_once(tmp_path, tp, pp, dp, ep, r):
    """Each expert's bytes come from a rank of its expert-parallel rank, locally where the GPU holds them, and
    fill the engine's fused w13/w2 tensors exactly once."""
    spec = moe_spec(tmp_path)
    dims = ParallelDims(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, dims, r, gpus_per_node=8, element_size=2, bucket_bytes=16 * 1024)
    check_exactly_once(plan)
    per_rank = spec.num_experts // ep
    for t in (t for bucket in plan.buckets for t in bucket if ".mlp.experts." in t.src_name):
        expert = int(t.src_name.split(".mlp.experts.")[1].split(".")[0])
        assert dims.ep_rank(t.src_rank) == expert // per_rank, t
        dst = dims.coords(t.dst_rank)
        holds = (dims.ep_rank(t.dst_rank) == expert // per_rank and dst["pp"] == dims.coords(t.src_rank)["pp"]
                 and dst["tp"] == dims.coords(t.src_rank)["tp"])
        assert t.local or not holds, f"{t} moves an expert shard its destination already holds"


def engine_rank_bytes(spec, r, k):
    """Bytes (2 per element) of engine rank k of R: its tensors but their vocabulary padding (never sent)."""
    shapes = hf_shapes(spec)
    return sum(p.length * unit_bytes(shapes, p, 2) for t in engine_tensors(spec, r, k) for p in t.pieces)


SEPARATE = [(*mesh, r, e) for mesh in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 1))
            for r, e in ((1, 2), (2, 2), (2, 4), (4, 4), (1, 8))]


@pytest.mark.parametrize("tp,pp,dp,r,e", SEPARATE)
def test_engines_on_gpus_of_their_own_receive_exactly_their_bytes_from_the_trainer(tp, pp, dp, r, e):
    """async_rl separate on GPUs of its own: E engine GPUs after the trainer's world. Each receives every byte of
    its engine rank exactly once and nothing more; a trainer GPU receives nothing and copies nothing locally; a byte
    crosses into a node once (4 GPUs a node: engines share the trainer's last node or have nodes of their own)."""
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    world = dims.world_size
    plan = make_plan(TINY, dims, r, gpus_per_node=4, element_size=2, bucket_bytes=256 * 1024, engine_gpus=e)
    assert plan.separate and plan.num_gpus == world + e
    assert plan.engine_ranks == [-1] * world + [i % r for i in range(e)]
    assert [len(engine) for engine in plan.engines()] == [r] * (e // r)
    check_exactly_once(plan)
    check_relays(plan)
    check_bucket_bounds(plan)
    assert set(bytes_entering_nodes(plan).values()) <= {1}
    links = plan.link_bytes()
    received = defaultdict(int)
    for (src, dst), nbytes in links.items():
        assert src != dst and dst >= world, (src, dst)
        received[dst] += nbytes
    assert received == {g: engine_rank_bytes(TINY, r, plan.engine_rank(g)) for g in range(world, world + e)}
    # The origin of every byte is a trainer GPU holding it; an engine GPU sends only what it forwards.
    assert all(t.src_rank < world and (t.via < 0 or t.via >= world) for b in plan.buckets for t in b)


def test_engines_of_their_own_are_fed_by_every_data_parallel_replica_and_the_nearest_first():
    """TP2 DP2 on GPUs 0-3, two engines of one GPU each on 4-5. 8 GPUs a node: every replica feeds them, within
    10% of each other. 4 GPUs a node: the engines have a node of their own, and each byte enters it once."""
    dims = ParallelDims(tp=2, pp=1, dp=2)
    plan = make_plan(TINY, dims, 1, gpus_per_node=8, element_size=2, engine_gpus=2)
    sent = defaultdict(int)
    for (src, _), nbytes in plan.link_bytes().items():
        sent[src] += nbytes
    assert min(sent[g] for g in range(4)) / max(sent[g] for g in range(4)) > 0.9, dict(sent)
    apart = make_plan(TINY, dims, 1, gpus_per_node=4, element_size=2, engine_gpus=2)
    stats = apart.stats()
    assert stats["inter_node_bytes"] == engine_rank_bytes(TINY, 1, 0)  # one copy enters; GPU 4 or 5 forwards it
    assert check_relays(apart) > 0


def test_llama3_8b_to_engines_of_their_own_moves_a_shard_not_the_model():
    """The peers' way to separate engines broadcasts every full tensor to every engine GPU (the whole model, 16
    GB, into each); here each of 8 engine GPUs (R2) receives its engine rank's half, and a byte crosses from the
    trainer's node into the engines' once."""
    spec = preset_or_hf_spec("llama3-8b")
    plan = make_plan(spec, ParallelDims(tp=4, pp=2, dp=1), 2, element_size=2, engine_gpus=8)
    stats = plan.stats()
    assert stats["max_recv_bytes_per_gpu"] == stats["engine_bytes_per_gpu"]
    assert stats["max_recv_bytes_per_gpu"] < stats["naive_bytes_per_gpu"] / 1.9
    assert stats["local_bytes"] == 0
    assert stats["inter_node_bytes"] == engine_rank_bytes(spec, 2, 0) + engine_rank_bytes(spec, 2, 1)
    assert "8 GPU(s)" not in describe_plan(plan) and "4 engine(s) of 2 GPU(s)" in describe_plan(plan)


def test_engine_gpus_that_do_not_split_into_engines_are_rejected():
    with pytest.raises(UserError, match="must divide the engines' 3 GPUs"):
        make_plan(TINY, ParallelDims(tp=2, pp=1, dp=1), 2, element_size=2, engine_gpus=3)

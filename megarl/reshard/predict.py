"""Time, not bytes: a plan's predicted refit time over the link model (``planner.LinkModel``: NVLink inside a
node, the network across nodes, HBM for local copies), with its bound, and the console's line about it."""

from __future__ import annotations

from collections import defaultdict

from megarl.reshard.planner import LinkModel, Plan
from megarl.reshard.transfers import Transfer


def describe_plan(plan: Plan, predict: bool = True, links: LinkModel | None = None) -> str:
    """One line for the console: engines, buckets, the busiest GPU's bytes and (``predict``, for GPUs) the
    predicted time over ``links`` (None: the measured defaults)."""
    stats = plan.stats()
    gib = 2**30
    engines = plan.engines()
    text = (f"{len(engines)} engine(s) of {plan.rollout_tp} GPU(s) {engines if len(engines) <= 8 else ''}"
            f"; {len(plan.buckets)} buckets; the busiest GPU receives {stats['max_recv_bytes_per_gpu'] / gib:.2f} "
            f"GiB from other GPUs of the {stats['engine_bytes_per_gpu'] / gib:.2f} GiB its engine rank holds")
    if predict and plan.num_gpus > 1:
        links = links or LinkModel()
        times = predict_ms(plan, links)
        over = (f"NVLink at {links.nvlink_gbps:g} GB/s" if plan.num_gpus <= plan.gpus_per_node else
                f"NVLink at {links.nvlink_gbps:g} GB/s and the network at {links.network_gbps:g} GB/s")
        text += f"; predicted {times['predicted_ms']:.1f} ms over {over} (bound {times['bound_ms']:.1f} ms)"
    return text


def predict_ms(plan: Plan, links: LinkModel | None = None) -> dict[str, float]:
    """Predicted refit time and its bound, in ms.

    A bucket takes its slowest GPU's time: the larger of what it sends and what it receives over NVLink
    (inside a node) and over the network (across nodes), each direction at its own rate, or its local
    copies, whichever is longer (they overlap), plus the fixed cost per bucket. The bound is the same
    for the whole refit as one bucket: bytes over the busiest link direction of any GPU.
    """
    links = links or LinkModel()
    node = lambda g: g // plan.gpus_per_node  # noqa: E731

    def seconds(transfers: list[Transfer]) -> float:
        per_gpu: dict[tuple[int, str], float] = defaultdict(float)
        for t in transfers:
            if t.local:
                per_gpu[t.dst_rank, "copy"] += 2 * t.nbytes / (links.hbm_copy_gbps * 1e9)  # read + write
                continue
            rate = links.nvlink_gbps if node(t.sender) == node(t.dst_rank) else links.network_gbps
            kind = "nvlink" if rate == links.nvlink_gbps else "network"
            per_gpu[t.sender, f"{kind} out"] += t.nbytes / (rate * 1e9)
            per_gpu[t.dst_rank, f"{kind} in"] += t.nbytes / (rate * 1e9)
        return max(per_gpu.values(), default=0.0)

    predicted = sum(seconds(b) * 1e3 + links.bucket_overhead_ms for b in plan.buckets)
    bound = seconds([t for b in plan.buckets for t in b]) * 1e3
    return {"predicted_ms": predicted, "bound_ms": bound}

"""Plan a refit once: for every byte of every engine rank's parameters, which trainer rank sends it.

The plan is pure data (no torch.distributed, no devices), so it is tested on CPU and reused for
every refit. Guarantees:
- every destination byte is produced exactly once (engine pieces are partitioned by the trainer's
  TP pieces of the same HF tensor);
- a slice the destination GPU already holds (colocated trainer rank) is copied locally;
- otherwise the nearest replica sends it: same node before other nodes, bytes balanced over the
  DP replicas (and over TP ranks for replicated tensors);
- a byte crosses into a node at most once (``relay``): where no GPU of the destination's node holds a
  slice, a replica on another node sends it to one GPU of that node that needs it (the landing GPU, bytes
  landed balanced over them), which forwards it over NVLink, in the next bucket, to the node's other GPUs
  of the same engine rank (``Transfer.via``);
- engines may also sit on GPUs of their own (``engine_gpus``), after the trainer's: each engine GPU then
  receives exactly its engine rank's bytes from the trainer replicas, by the same rules (nearest replica, one
  crossing into a node, balanced), and a trainer GPU only sends;
- transfers are grouped into buckets (``megarl.reshard.transfers.bucketize``), layer by layer, so that no GPU
  sends or receives more than ``bucket_bytes`` per bucket, forwarded bytes included: that bounds the executor's
  extra memory whatever the model size; of them, no more across nodes than the network moves while NVLink moves
  a bucket, so that the network is busy in every bucket rather than holding up a few;
- with ``weight_dtype="fp8"`` (rollout.weight_dtype), the transfers still move the trainer's bytes of every engine
  tensor, and ``Plan.fp8`` carries the block geometry of each one the engine holds in FP8 (megarl.reshard.fp8:
  the linear layers' weights), from which the executor quantizes them into the engine's ``weight`` and
  ``weight_scale_inv``.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from megarl.config.rollout import FP8_BLOCKS
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.mapping import ParamRule, Piece, hf_shapes, mcore_pieces, mcore_shape, param_rules, pipeline_stage
from megarl.models.spec import ModelSpec
from megarl.reshard.engine_layout import EngineTensor, check_rollout_tp, engine_tensors, matrix_shape
from megarl.reshard.fp8 import Fp8Tensor, engine_geometry, layout_problems
from megarl.reshard.fp8_reference import BLOCK
from megarl.reshard.transfers import Transfer, Unit, bucketize, row_bytes


@dataclass
class Plan:
    spec: ModelSpec
    dims: ParallelDims
    rollout_tp: int
    gpus_per_node: int
    element_size: int
    bucket_bytes: int
    padded_vocab: int
    src_shapes: dict[str, tuple[int, ...]]
    """Trainer tensor shapes by canonical Megatron name (identical on every rank holding it)."""
    dst_shapes: list[dict[str, tuple[int, ...]]]
    """Engine tensor shapes by engine name, per engine rank."""
    engine_ranks: list[int] = field(default_factory=list)
    """The engine rank each GPU (global rank) holds, chosen by ``place_engines``; -1 on a trainer GPU that holds
    none (engines on GPUs of their own, which come after the trainer's)."""
    buckets: list[list[Transfer]] = field(default_factory=list)
    fp8: list[dict[str, Fp8Tensor]] = field(default_factory=list)
    """Per engine rank, its tensors held in FP8 by engine name, with their block geometry (rollout.weight_dtype =
    fp8; empty: every engine tensor holds the trainer's dtype). ``dst_shapes`` and the transfers describe the
    trainer-dtype window such a tensor is quantized from."""

    def fp8_tensors(self, rank: int) -> dict[str, Fp8Tensor]:
        """The FP8 engine tensors GPU ``rank`` holds (none on a trainer GPU without an engine rank, or in bf16)."""
        r = self.engine_ranks[rank]
        return self.fp8[r] if self.fp8 and r >= 0 else {}

    @property
    def num_gpus(self) -> int:
        """GPUs taking part in the refit: the trainer's world, and the engines' own GPUs after it if any."""
        return len(self.engine_ranks)

    @property
    def separate(self) -> bool:
        """The engines are on GPUs of their own: no GPU both trains and generates."""
        return self.num_gpus > self.dims.world_size

    def engine_rank(self, rank: int) -> int:
        return self.engine_ranks[rank]

    def engine_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The engine tensor shapes GPU ``rank`` holds: none on a trainer GPU without an engine rank."""
        r = self.engine_ranks[rank]
        return self.dst_shapes[r] if r >= 0 else {}

    def engines(self) -> list[list[int]]:
        """Each engine's GPUs (global ranks) in engine-rank order: within a node, the k-th GPU holding
        engine rank r belongs to that node's k-th engine."""
        return engine_groups(self.engine_ranks, self.rollout_tp)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes each (sender, dst) GPU pair carries per refit; (g, g) is the local copy on GPU g."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for bucket in self.buckets:
            for t in bucket:
                out[t.sender, t.dst_rank] += t.nbytes
        return dict(out)

    def stats(self) -> dict[str, float]:
        links = self.link_bytes()
        world = self.num_gpus
        cross = sum(b for (s, d), b in links.items() if s != d)
        inter_node = sum(b for (s, d), b in links.items() if s // self.gpus_per_node != d // self.gpus_per_node)
        recv = [sum(b for (s, d), b in links.items() if d == g and s != g) for g in range(world)]
        send = [sum(b for (s, d), b in links.items() if s == g and d != g) for g in range(world)]
        engine_bytes = sum(math.prod(s) for s in self.dst_shapes[0].values()) * self.element_size
        full_model = self.spec.num_params() * self.element_size
        return {
            "num_buckets": len(self.buckets),
            "num_transfers": sum(len(b) for b in self.buckets),
            "local_bytes": sum(b for (s, d), b in links.items() if s == d),
            "cross_gpu_bytes": cross,
            "inter_node_bytes": inter_node,
            "max_recv_bytes_per_gpu": max(recv),
            "max_send_bytes_per_gpu": max(send),
            "engine_bytes_per_gpu": engine_bytes,
            # verl/slime all-gather every tensor to full size on every GPU (TP all-gather, PP broadcast); to engines
            # on GPUs of their own they broadcast every full tensor from one trainer rank.
            "naive_bytes_per_gpu": full_model if self.separate else full_model * (1 - 1 / self.dims.tp / self.dims.pp),
            "naive_gathered_bytes_per_gpu": full_model,
        }


def _rules_by_hf(spec: ModelSpec, tp: int, padded_vocab: int) -> dict[str, list[tuple[int, ParamRule, Piece]]]:
    index: dict[str, list[tuple[int, ParamRule, Piece]]] = defaultdict(list)
    for rule in param_rules(spec):
        for t in range(tp):
            for piece in mcore_pieces(rule, spec, t, tp, padded_vocab):
                index[piece.hf].append((t, rule, piece))
    return index


def holders(rule: ParamRule, tp_rank: int, spec: ModelSpec, dims: ParallelDims) -> tuple[int, ...]:
    """The trainer ranks holding TP shard ``tp_rank`` of ``rule``: its pipeline stage's DP replicas (a layer's
    stage interleaved over virtual pipeline chunks as Megatron places it), those of the expert's expert-parallel
    rank for an MoE expert."""
    owner = None if rule.expert is None else rule.expert // (spec.num_experts // dims.ep)
    return _holders(dims, tp_rank, pipeline_stage(rule.mcore, spec, dims.pp, dims.vpp), owner)


@functools.lru_cache(maxsize=1 << 14)
def _holders(dims: ParallelDims, tp_rank: int, stage: int, owner: int | None) -> tuple[int, ...]:
    ranks = [dims.rank(tp=tp_rank, dp=dp, pp=stage) for dp in range(dims.dp)]
    return tuple(g for g in ranks if owner is None or dims.ep_rank(g) == owner)


def unit_bytes(shapes: dict[str, tuple[int, ...]], piece: Piece, element_size: int) -> int:
    """Bytes per unit of a piece's length: a row of its HF tensor (dim 0) or a column (dim 1); ``shapes``:
    mapping.hf_shapes of the model."""
    return row_bytes(shapes[piece.hf], piece.dim, element_size)


def engine_groups(engine_ranks: list[int], rollout_tp: int) -> list[list[int]]:
    """Engines as lists of global ranks in engine-rank order, from the engine rank of each GPU: the k-th
    GPU (in rank order) with engine rank r joins the k-th engine whose first GPU is on or after it."""
    seen: dict[int, int] = defaultdict(int)
    engines: list[list[int]] = []
    for g, r in enumerate(engine_ranks):
        if r < 0:
            continue
        k = seen[r]
        seen[r] += 1
        while len(engines) <= k:
            engines.append([-1] * rollout_tp)
        engines[k][r] = g
    assert all(-1 not in e for e in engines), engine_ranks
    return engines


def held_bytes(spec: ModelSpec, dims: ParallelDims, rollout_tp: int, element_size: int,
               vocab_pad_multiple: int) -> list[list[int]]:
    """held[g][r]: bytes of engine rank r's tensors that trainer rank g already holds."""
    padded_vocab = spec.padded_vocab_size(dims.tp, vocab_pad_multiple)
    index = _rules_by_hf(spec, dims.tp, padded_vocab)
    held = [[0] * rollout_tp for _ in range(dims.world_size)]
    shapes = hf_shapes(spec)
    for r in range(rollout_tp):
        for tensor in engine_tensors(spec, rollout_tp, r):
            for dpiece in tensor.pieces:
                unit = unit_bytes(shapes, dpiece, element_size)
                for t, rule, spiece in index[dpiece.hf]:
                    lo, hi = max(spiece.start, dpiece.start), min(spiece.stop, dpiece.stop)
                    if lo < hi:
                        for g in holders(rule, t, spec, dims):
                            held[g][r] += (hi - lo) * unit
    return held


def place_engines(held: list[list[int]], rollout_tp: int, gpus_per_node: int, max_search: int = 100_000
                  ) -> list[int]:
    """The engine rank of each GPU, chosen node by node so that the most engine bytes are already on the
    GPU that needs them: each node's GPUs take every engine rank equally often (its engines stay inside
    it). Exhaustive where the node has at most ``max_search`` assignments (8 GPUs always), greedy beyond;
    ties keep engine rank = global rank % R. Engines span nodes only when R exceeds a node: then that."""
    world = len(held)
    node = min(gpus_per_node, world)
    default = [g % rollout_tp for g in range(world)]
    if rollout_tp == 1 or node % rollout_tp or world % node:
        return default
    out: list[int] = []
    per_rank = node // rollout_tp
    for first in range(0, world, node):
        gpus = list(range(first, first + node))
        if math.factorial(node) // math.factorial(per_rank) ** rollout_tp <= max_search:
            score = functools.partial(_placement_score, held=held, gpus=gpus, rollout_tp=rollout_tp)
            out += max(_arrangements([per_rank] * rollout_tp), key=score)
            continue
        assign = [-1] * node
        left = [per_rank] * rollout_tp
        for _, i, r in sorted((-held[g][r], i, r) for i, g in enumerate(gpus) for r in range(rollout_tp)):
            if assign[i] < 0 and left[r]:
                assign[i] = r
                left[r] -= 1
        out += assign
    return out


def _placement_score(assign: tuple[int, ...], held: list[list[int]], gpus: list[int], rollout_tp: int
                     ) -> tuple[int, int]:
    """Bytes already local, then (for ties) GPUs keeping engine rank = global rank % R."""
    pairs = list(zip(gpus, assign, strict=True))
    return sum(held[g][r] for g, r in pairs), sum(r == g % rollout_tp for g, r in pairs)


def _arrangements(left: list[int]) -> Iterator[tuple[int, ...]]:
    """Every sequence holding value r exactly left[r] times."""
    if not any(left):
        yield ()
        return
    for r, n in enumerate(left):
        if n:
            left[r] -= 1
            for rest in _arrangements(left):
                yield (r, *rest)
            left[r] += 1


class _Run(NamedTuple):
    """A run of an engine tensor that one trainer TP piece covers, and the trainer ranks holding it."""

    sources: dict[int, tuple[str, int]]
    """Holding rank -> (trainer tensor, offset of the run in it)."""
    dim: int
    dst_offset: int
    length: int
    nbytes: int

    def split(self, max_bytes: int) -> list[_Run]:
        """Pieces of at most ``max_bytes`` (a unit at least), cut as ``split_transfer`` cuts a transfer."""
        per_unit = self.nbytes // self.length
        step = max(1, max_bytes // per_unit)
        out = []
        for i in range(0, self.length, step):
            length = min(step, self.length - i)
            sources = {g: (name, offset + i) for g, (name, offset) in self.sources.items()}
            out.append(_Run(sources, self.dim, self.dst_offset + i, length, length * per_unit))
        return out


def _runs(tensor: EngineTensor, index: dict[str, list[tuple[int, ParamRule, Piece]]],
          shapes: dict[str, tuple[int, ...]], spec: ModelSpec, dims: ParallelDims, element_size: int) -> list[_Run]:
    """The runs of one engine rank's ``tensor``, in piece order: the same for every GPU of that engine rank."""
    out = []
    for dpiece in tensor.pieces:
        unit = unit_bytes(shapes, dpiece, element_size)
        # Trainer pieces of the same HF tensor, grouped by the range they cover.
        by_range: dict[tuple[int, int], list[tuple[int, ParamRule, int]]] = defaultdict(list)
        for t, rule, spiece in index[dpiece.hf]:
            lo, hi = max(spiece.start, dpiece.start), min(spiece.stop, dpiece.stop)
            if lo < hi:
                by_range[lo, hi].append((t, rule, spiece.offset + lo - spiece.start))
        covered = sum(hi - lo for lo, hi in by_range)
        assert covered == dpiece.length, (tensor.name, dpiece, covered)
        for (lo, hi), options in sorted(by_range.items()):
            sources = {g: (rule.mcore, off) for t, rule, off in options for g in holders(rule, t, spec, dims)}
            out.append(_Run(sources, dpiece.dim, dpiece.offset + lo - dpiece.start, hi - lo, (hi - lo) * unit))
    return out


class _Senders:
    """Chooses who sends each run: the destination itself where it holds it, else the replica with the fewest bytes
    sent so far, on the destination's node where one is; a run no GPU of the node holds crosses into it once."""

    def __init__(self, gpus_per_node: int, bucket_bytes: int, network_bytes: int, relay: bool) -> None:
        self.node, self.bucket_bytes, self.network_bytes, self.relay = gpus_per_node, bucket_bytes, network_bytes, relay
        self.sent: dict[int, int] = defaultdict(int)
        self.landed: dict[int, int] = defaultdict(int)

    def group(self, engine_ranks: list[int], tensors: list[tuple[str, list[_Run]]]) -> list[Unit]:
        """The transfers into every GPU (of engine rank ``engine_ranks[g]``) of one engine tensor, whose name and
        runs on engine rank r are ``tensors[r]``."""
        units: list[Unit] = []
        into_node: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for dst, r in enumerate(engine_ranks):
            if r < 0:
                continue
            name, runs = tensors[r]
            for j, run in enumerate(runs):
                src = self._direct(run, dst)
                if src is None:  # the same bytes for every GPU of this engine rank on the node: sent in once, below
                    into_node[dst // self.node, r, j].append(dst)
                else:
                    units.append((_transfer(run, name, dst, src), []))
        for (_, r, j), dsts in into_node.items():
            units += self._relayed(tensors[r][1][j], tensors[r][0], dsts)
        return units

    def _direct(self, run: _Run, dst: int) -> int | None:
        """The GPU that sends ``run`` to ``dst``; None where it is relayed into ``dst``'s node."""
        if dst in run.sources:
            return dst
        have = sorted(run.sources)
        near = [h for h in have if h // self.node == dst // self.node]
        if not near and self.relay:
            return None
        return _least(near or have, self.sent, run.nbytes)

    def _relayed(self, run: _Run, name: str, dsts: list[int]) -> list[Unit]:
        """The run crosses into the node of ``dsts`` once, piece by piece (as ``bucketize`` cuts them), each to the
        GPU of ``dsts`` that has landed the fewest bytes, which forwards it to the others."""
        units = []
        for piece in run.split(min(self.network_bytes, self.bucket_bytes // max(1, len(dsts) - 1))):
            landing = _least(dsts, self.landed, piece.nbytes)
            feeder = _transfer(piece, name, landing, _least(sorted(piece.sources), self.sent, piece.nbytes))
            units.append((feeder, [replace(feeder, dst_rank=g, via=landing) for g in dsts if g != landing]))
        return units


def _least(gpus: list[int], load: dict[int, int], nbytes: int) -> int:
    """The GPU of ``gpus`` with the least ``load`` (the first on ties), charged ``nbytes``."""
    g = min(gpus, key=lambda h: (load[h], h))
    load[g] += nbytes
    return g


def _transfer(run: _Run, name: str, dst: int, src: int) -> Transfer:
    src_name, src_offset = run.sources[src]
    return Transfer(src, src_name, dst, name, run.dim, src_offset, run.dst_offset, run.length, run.nbytes)


def make_plan(spec: ModelSpec, dims: ParallelDims, rollout_tp: int, *, gpus_per_node: int = 8,
              element_size: int = 2, bucket_bytes: int = 256 * 2**20, vocab_pad_multiple: int = 128,
              relay: bool = True, links: LinkModel | None = None, engine_gpus: int = 0,
              weight_dtype: str = "bf16", fp8_block: int = BLOCK) -> Plan:
    """Plan the refit from the trainer mesh ``dims`` into engines of ``rollout_tp`` GPUs each.

    ``engine_gpus`` 0 (colocation): every GPU runs a trainer rank and one engine rank; which GPUs form each
    engine, and which engine rank each holds, is ``place_engines``' choice: the most bytes already local.
    ``engine_gpus`` > 0: the engines have GPUs of their own, global ranks ``world_size`` on, engine rank =
    (rank - world_size) % rollout_tp; every byte they hold comes from the trainer's GPUs. ``relay``:
    bytes that no GPU of a node holds cross into it once and are forwarded inside it (False: every GPU
    that needs them gets them from another node, for comparison). ``links`` (None: the measured defaults) sets
    how many bytes cross nodes per GPU and bucket: as many as NVLink moves in the same time. ``weight_dtype``
    (rollout.weight_dtype): "fp8" adds the block geometry of every quantized engine tensor (``Plan.fp8``) in blocks of
    ``fp8_block`` x ``fp8_block`` (rollout.fp8_block), and refuses a model whose shapes the engines' FP8 loaders
    refuse at this ``rollout_tp`` and block.
    """
    world = dims.world_size
    if rollout_tp < 1 or (engine_gpus or world) % rollout_tp:
        raise UserError(f"rollout.tensor_parallel = {rollout_tp} must divide " + (
            f"the engines' {engine_gpus} GPUs (each engine spans R of them)." if engine_gpus else
            f"the world size {world} (each engine spans R colocated GPUs)."))
    check_rollout_tp(spec, rollout_tp)
    stages = dims.pp * (dims.vpp or 1)
    if spec.num_kv_heads % dims.tp or spec.num_layers % stages:
        vpp = f" VPP={dims.vpp}" if dims.vpp else ""
        raise UserError(f"trainer layout TP={dims.tp} PP={dims.pp}{vpp} does not fit the model "
                        f"(num_key_value_heads={spec.num_kv_heads}, num_hidden_layers={spec.num_layers}); TP must "
                        "divide the first and PP (times VPP, if set) the second.")
    padded_vocab = spec.padded_vocab_size(dims.tp, vocab_pad_multiple)
    rules = param_rules(spec)
    src_shapes = {r.mcore: mcore_shape(r, spec, dims.tp, padded_vocab) for r in rules}
    layouts = [engine_tensors(spec, rollout_tp, r) for r in range(rollout_tp)]
    fp8_layouts: list[dict[str, Fp8Tensor]] = []
    if weight_dtype == "fp8":
        check_fp8_layout(spec, rollout_tp, fp8_block)
        full = hf_shapes(spec)
        fp8_layouts = [{g.name: g for g in (engine_geometry(t, full, (fp8_block, fp8_block)) for t in layout)
                        if g is not None}
                       for layout in layouts]
    elif weight_dtype != "bf16":
        raise ValueError(f"make_plan: weight_dtype must be bf16 or fp8, not {weight_dtype!r}")
    if engine_gpus:
        placed = [-1] * world + [i % rollout_tp for i in range(engine_gpus)]
    else:
        placed = place_engines(held_bytes(spec, dims, rollout_tp, element_size, vocab_pad_multiple), rollout_tp,
                               gpus_per_node)
    plan = Plan(spec=spec, dims=dims, rollout_tp=rollout_tp, gpus_per_node=gpus_per_node,
                element_size=element_size, bucket_bytes=bucket_bytes, padded_vocab=padded_vocab,
                src_shapes=src_shapes, dst_shapes=[{t.name: t.shape for t in layout} for layout in layouts],
                engine_ranks=placed, fp8=fp8_layouts)
    index = _rules_by_hf(spec, dims.tp, padded_vocab)
    shapes = hf_shapes(spec)
    links = links or LinkModel()
    network_bytes = max(1, int(bucket_bytes * links.network_gbps / links.nvlink_gbps))
    senders = _Senders(gpus_per_node, bucket_bytes, network_bytes, relay)
    # Engine tensors in forward order; every engine rank's tensor of one name forms one group.
    units_by_group = [senders.group(plan.engine_ranks, [(layout[i].name, _runs(layout[i], index, shapes, spec, dims,
                                                                               element_size)) for layout in layouts])
                      for i in range(len(layouts[0]))]
    plan.buckets = bucketize(units_by_group, bucket_bytes, network_bytes, gpus_per_node)
    return plan


def check_fp8_layout(spec: ModelSpec, rollout_tp: int, block: int = BLOCK, field: str = "rollout.weight_dtype") -> None:
    """Refuse, in one paragraph, a model the FP8 hand-over cannot serve at engine TP ``rollout_tp`` in blocks of
    ``block`` (rollout.fp8_block): shapes the engines' FP8 loaders refuse (``fp8.layout_problems``), or MoE experts
    (their FP8 layout is not planned)."""
    if spec.is_moe:
        raise UserError(f"{field} = fp8: this model has MoE experts ({spec.hf_config.get('architectures')}), whose "
                        "FP8 layout (FusedMoE's w13_weight_scale_inv, w2_weight_scale_inv) the hand-over does not "
                        f"plan yet. Set {field}: bf16.")
    problems = layout_problems(spec, rollout_tp, block)
    if problems:
        # Another block at this TP first (SmolLM2-135M loads in blocks of 64), then other TPs at this block.
        fixes = [f"rollout.fp8_block: {b}" for b in FP8_BLOCKS
                 if b != block and not layout_problems(spec, rollout_tp, b)]
        fits = [r for r in (1, 2, 4, 8) if r != rollout_tp and not layout_problems(spec, r, block)
                and spec.num_attention_heads % r == 0]
        if fits:
            fixes.append(f"rollout.tensor_parallel in {fits}")
        fixes.append(f"{field}: bf16")
        raise UserError(f"{field} = fp8 with rollout.tensor_parallel = {rollout_tp}: the engines' FP8 loaders "
                        f"(rollout.fp8_block = {block}: {block} x {block} blocks) refuse this model's shapes: "
                        f"{'; '.join(problems)}. Use {', '.join(fixes[:-1])}{', or ' if len(fixes) > 1 else ''}"
                        f"{fixes[-1]}.")


def check_fp8_rollout(cfg: Any, spec: ModelSpec) -> None:
    """Start-up (megarl.loop.bootstrap.check_run): refuse rollout.weight_dtype = fp8 where the run cannot serve it,
    one paragraph each naming the field and the fix. The vLLM engine is refused by the config itself."""
    if cfg.rollout.weight_dtype != "fp8":
        return
    if cfg.actor.adapter_handover():
        raise UserError("rollout.weight_dtype = fp8 with actor.lora.handover = adapter: the engine would serve bf16 "
                        "LoRA adapters over FP8 base weights, which the adapter hand-over (megarl.lora.handover) "
                        "cannot build: it hands over the base weights once, unquantized, and the adapters as files. "
                        "Set actor.lora.handover: merged (the merged weights are quantized on every hand-over), or "
                        "rollout.weight_dtype: bf16.")
    check_fp8_layout(spec, cfg.rollout.tensor_parallel, cfg.rollout.fp8_block)
    if cfg.rollout.engine == "sglang":  # the engine starts in block FP8 (megarl.rollout.sglang_fp8)
        from megarl.rollout.sglang_fp8 import check_fp8_engine_args

        aliases = True if cfg.rollout.alias_weights is True else None  # auto: off with fp8 (aliasing.py)
        check_fp8_engine_args(dict(cfg.rollout.engine_args), aliases=aliases)


def fp8_rollout_warning(cfg: Any) -> str | None:
    """The start-up warning for an FP8 rollout whose samples go uncorrected (None: none to give)."""
    if cfg.rollout.weight_dtype != "fp8" or cfg.algorithm.rollout_correction != "none":
        return None
    return ("megarl: warning: rollout.weight_dtype = fp8 with algorithm.rollout_correction = none: the engine samples "
            "from FP8 weights, a distribution other than the bf16 trainer's, and nothing corrects for it. Set "
            "algorithm.rollout_correction: token_tis (truncated importance sampling per token) to weight each token "
            "by trainer / rollout probability.")


def aliases(plan: Plan) -> list[dict[str, tuple[str, int]]]:
    """Per GPU (global rank): the engine tensors of its engine rank that are, byte for byte, one run of a trainer
    tensor on that GPU, as engine name -> (trainer name, element offset). The engine can map these instead of
    holding a copy (rollout.alias_weights). With engine TP equal to trainer TP and one pipeline stage they are
    o_proj, gate_up, down_proj, the norms and a vocabulary padded alike; QKV (grouped per KV head in Megatron)
    and fused experts are not."""
    into: list[dict[str, list[Transfer]]] = [defaultdict(list) for _ in range(plan.num_gpus)]
    for bucket in plan.buckets:
        for t in bucket:
            into[t.dst_rank][t.dst_name].append(t)
    return [_aliased(plan, rank, by_name) for rank, by_name in enumerate(into)]


def _aliased(plan: Plan, rank: int, into: dict[str, list[Transfer]]) -> dict[str, tuple[str, int]]:
    dst_shapes = plan.engine_shapes(rank)
    out = {}
    for name, transfers in into.items():
        src = {t.src_name for t in transfers}
        if len(src) > 1 or any(not t.local for t in transfers) or len({t.dim for t in transfers}) > 1:
            continue
        src_name, dim = src.pop(), transfers[0].dim
        src_shape, dst_shape = plan.src_shapes[src_name], dst_shapes[name]
        transfers.sort(key=lambda t: t.dst_offset)
        ends = [t.dst_offset + t.length for t in transfers]
        gaps = [t.dst_offset != e for t, e in zip(transfers[1:], ends[:-1], strict=True)]
        if transfers[0].dst_offset != 0 or any(gaps):
            continue
        if dim == 0:
            shift = {t.src_offset - t.dst_offset for t in transfers}
            row = row_bytes(src_shape, 0, 1)
            if len(shift) == 1 and ends[-1] == dst_shape[0] and row == row_bytes(dst_shape, 0, 1):
                out[name] = (src_name, shift.pop() * row)
        elif (all(t.src_offset == t.dst_offset for t in transfers) and ends[-1] == src_shape[1]
              and matrix_shape(dst_shape) == tuple(src_shape)):
            out[name] = (src_name, 0)  # every column of every row: the whole tensor
    return out


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Bandwidths (GB/s, each direction) that turn a plan's bytes into time. Defaults measured on H200s:
    NCCL over NV18 NVLink (365 GB/s per direction in an exchange of 4 GiB messages), the segment copy
    kernel's HBM rate (3.7 TB/s read + write, benchmarks/results/h200/kernel_bandwidth.json); the network
    is one 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE), not measured here."""

    nvlink_gbps: float = 365.0
    network_gbps: float = 50.0
    hbm_copy_gbps: float = 3700.0
    bucket_overhead_ms: float = 0.25
    """Fixed cost per bucket (syncs, NCCL launch): 0.22-0.29 ms measured on two H200s."""

"""Run a refit plan on this rank: local copies, pack -> send/recv -> unpack, bucket by bucket.

Everything that can be prepared is prepared once, in the constructor: for every bucket the segment
tables of its local copies, its pack and its unpack (QKV/fc1 regrouping is part of them), and, bound
to the tensors' addresses (``bind``), the staging pool (two send and two receive buffers of
``plan.bucket_bytes``, one allocation) and a compiled ``SegmentCopy`` per table. A refit then only
launches kernels and posts P2P operations. ``release`` frees the buffers while the trainer's weights
are away during rollout.

On GPU, three streams overlap the pipeline: pack(k+1) on the pack stream, transfer(k) on the
communication stream, unpack(k-1) on the unpack stream, ordered by events; buffer k % 2 is
reused only after bucket k-2 finished with it. On CPU (gloo) the same schedule runs in order.

Relayed transfers (``planner.Transfer.via``): a GPU that received bytes in bucket k which other GPUs of its
node need forwards them in bucket k+1, copying them from where they landed (receive buffer k % 2, or the
landing buffer) into its send buffer after the pack of k+1, once transfer(k) is done; both stay intact until
bucket k+2 (the next round) receives, which waits for that pack.

``in_engine=True`` splits the work with an engine process (megarl.reshard.handover): this side only
packs and sends, and receives into a landing buffer; ``engine_copy()`` describes the rest (local copies
from the trainer tensors, unpacking from the landing buffer) as segment tables, which the engine rank
runs into its own parameters. The landing buffer holds at most ``landing_bytes`` (whatever the model's
size): the buckets form rounds (``landing_rounds``, the same on every rank) in which no rank receives more,
and a hand-over is ``refit(r)`` then the engine's copy of round r, for every round in order.

FP8 rollout (``plan.fp8``, rollout.weight_dtype = fp8): the engine holds its linear layers' weights as float8_e4m3fn
``...weight`` and float32 ``...weight_scale_inv``. The copies write such a tensor's window of the trainer's weights
(trainer dtype, engine layout) into a staging arena instead, and once its last bucket is in, one pass of
megarl._C.fp8_block_quantize per part quantizes it into the engine's two parameters (``Fp8Tensor.quantize``); a
staging region is reused by tensors of later buckets, so the arena holds the tensors in flight, never the engine's
weights. A tensor this GPU's trainer tensors fill alone within one bucket is copied into one scratch buffer and
quantized at once, one such tensor after the other. Where the window is byte for byte one of this GPU's trainer
tensors (engine TP = trainer TP: o_proj, gate_up, down_proj of its pipeline stage, QKV with one kv head per rank, as
``planner.aliases`` finds them), it is quantized from the trainer's tensor directly, with no copy at all. In
``in_engine`` mode the trainer's side does all of that too, from its tensors and the landing buffer, but quantizes into
an output buffer of its own (``fp8_out``), in steps whose output fits the landing limit, the same steps on every GPU
(``_fp8_schedule``), and the engine's copy of each step moves those bytes into its float8 ``weight`` and float32
``weight_scale_inv`` as it moves the rest: the engine process runs no quantization.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from megarl.errors import UserError
from megarl.reshard.engine_layout import matrix_shape
from megarl.reshard.fp8 import Fp8Tensor
from megarl.reshard.handover import EngineCopy
from megarl.reshard.kernels import Segment, extension, segment_table
from megarl.reshard.planner import Plan, aliases
from megarl.reshard.transfers import Transfer, row_bytes
from megarl.reshard.verify import check_reports, engine_names, expected_checksums, mismatched, spans_processes


class ReportsChecksums(Protocol):
    """An engine rank as ``Resharder.verify`` needs it (megarl.rollout.group.GroupEngine)."""

    def checksums(self, num_tensors: int) -> torch.Tensor:
        """int64 [num_tensors, 2]: the checksums of the parameters this engine rank holds (megarl.reshard.verify)."""
        ...


@dataclass
class _BucketSpec:
    """A bucket's segment tables and regions: what ``Resharder.bind`` compiles against live addresses."""

    local: torch.Tensor | None
    pack: torch.Tensor | None
    unpack: torch.Tensor | None
    sends: list[tuple[int, int, int]]
    recvs: list[tuple[int, int, int]]
    buffer: int
    landing: int | None = None
    forward: torch.Tensor | None = None
    fp8_local: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Bucket:
    local: Any | None
    pack: Any | None
    unpack: Any | None
    sends: list[tuple[int, int, int]]
    """(peer, offset, nbytes) regions of this bucket's send buffer."""
    recvs: list[tuple[int, int, int]]
    buffer: int
    landing: int | None = None
    """Offset of this bucket's receive regions in the landing buffer (``in_engine`` mode)."""
    forward: Any | None = None
    """Copies of bytes the bucket before received (from the other receive buffer, or the landing buffer) into
    this bucket's send buffer, for relayed transfers."""
    fp8_local: list[tuple[str, Any]] = field(default_factory=list)
    """FP8 tensors this GPU's trainer tensors fill alone in this bucket: each copied into the scratch buffer and
    quantized from it at once, one after the other."""


def _segment(t: Transfer, src_shape: tuple[int, ...], dst_shape: tuple[int, ...], element_size: int,
             src_index: int, dst_index: int, *, src_packed: int | None = None,
             dst_packed: int | None = None) -> Segment:
    """The byte segment of transfer ``t``; a packed side is a tight run at the given buffer offset."""
    if t.dim == 0:
        row = row_bytes(src_shape, 0, element_size)
        nbytes = t.length * row
        src_off = t.src_offset * row if src_packed is None else src_packed
        dst_off = t.dst_offset * row if dst_packed is None else dst_packed
        return Segment(src_index, src_off, nbytes, dst_index, dst_off, nbytes, 1, nbytes)
    # A column slice of a 2-D tensor: one row segment per matrix row.
    rows, run = src_shape[0], t.length * element_size
    src_off, src_stride = ((t.src_offset * element_size, src_shape[1] * element_size) if src_packed is None
                           else (src_packed, run))
    dst_off, dst_stride = ((t.dst_offset * element_size, matrix_shape(dst_shape)[1] * element_size)
                           if dst_packed is None
                           else (dst_packed, run))
    return Segment(src_index, src_off, src_stride, dst_index, dst_off, dst_stride, rows, run)


class Resharder:
    """Executes ``plan`` on rank ``rank`` of ``group``: reads trainer tensors, writes engine tensors.

    ``src`` maps canonical Megatron names to this rank's trainer parameters; ``dst`` maps engine
    names to this rank's engine parameters (the engine's own tensors, written in place). Both stay
    at the addresses they had at the last ``bind`` (the constructor binds) until ``release``; after it,
    their storages may move (offloaded and brought back) and ``dst``'s tensors may be replaced in the same
    dict (freed during rollout, allocated again), and the next refit binds again. With
    ``in_engine`` there is no ``dst``: the engine rank writes its parameters itself from ``engine_copy()``.
    With the engines on GPUs of their own (``plan.separate``), a trainer GPU holds no engine tensors (``dst`` is
    empty) and an engine GPU no trainer tensors (``src`` is empty; pass ``device``). ``group``: the process group
    over the plan's GPUs, ``rank`` and every peer counted within it (None: the world), so the hand-over may span
    processes whose world ranks differ from the plan's, such as engine workers beside a trainer's world.
    """

    def __init__(self, plan: Plan, rank: int, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor] | None,
                 group: dist.ProcessGroup | None = None, device: torch.device | None = None, *,
                 in_engine: bool = False, landing_bytes: int | None = None, aliased: Collection[str] = (),
                 dtype: torch.dtype | None = None) -> None:
        """``dtype``: the trainer's, which the engine's tensors must hold (the copy moves bits); taken from ``src``
        and checked against it where this rank holds trainer tensors, needed where it holds none.
        ``landing_bytes`` (``in_engine``): the most the landing buffer holds (None: twice the bucket size, the
        receive buffers the other mode has; 0: every remote byte, one round). ``aliased`` (``in_engine``): this
        rank's engine tensors that are views of its trainer tensors (megarl.reshard.aliasing): never copied, but
        still checksummed by the engine (a stale mapping would show)."""
        assert (dst is None) == in_engine, "pass engine tensors (dst) exactly when the engine does not copy itself"
        assert in_engine or not aliased, "only an engine that copies itself can map the trainer's tensors"
        assert group is None or dist.get_world_size(group) == plan.num_gpus, (
            f"the hand-over group has {dist.get_world_size(group)} members for a plan over {plan.num_gpus} GPUs")
        self.plan, self.rank, self.group, self.in_engine = plan, rank, group, in_engine
        limit = 2 * plan.bucket_bytes if landing_bytes is None else landing_bytes
        self.rounds = landing_rounds(plan, limit) if in_engine else [(0, len(plan.buckets))]
        """Bucket ranges [start, end): ``refit(r)`` runs round r; outside ``in_engine`` one round holds them all."""
        self.device = device or next(iter((dst or src).values())).device
        self.fp8 = plan.fp8_tensors(rank)
        """This GPU's engine tensors held in FP8, quantized on the way (module docstring)."""
        self._check(src, dst, dtype)
        self.src_names = sorted({t.src_name for b in plan.buckets for t in b if t.src_rank == rank})
        self.dst_names = sorted({t.dst_name for b in plan.buckets for t in b if t.dst_rank == rank})
        self.checksum_names = engine_names(plan)[rank]
        """The engine tensors whose checksums ``verify`` compares: ``dst_names``, and the FP8 ones' scales."""
        self.aliased = frozenset(aliased)
        # FP8: tensors quantized straight from a trainer tensor of this GPU (name -> (trainer name, element
        # offset)); those this GPU's trainer tensors fill alone within one bucket, copied one at a time into the
        # scratch buffer and quantized at once; the others through the staging arena (name -> byte offset), each
        # quantized after its last bucket (_quantize_after).
        routes = _fp8_routes(plan)
        self._direct, self._scratched, staged = routes[rank]
        self._scratch_bytes = _scratch_bytes(plan, rank, self._scratched)
        self._staged, self._staging_bytes = _staging(plan, rank, staged)
        quantized = _quantizations(plan, routes)
        self._quantize_after = {k: after for k, names in quantized[rank].items()
                                if (after := [n for n in names if n not in self._scratched])}
        src_index = {n: i for i, n in enumerate(self.src_names)}
        # In-engine, the engine's copy writes checksum_names (its tensors and, in FP8, their scales); the trainer
        # writes the FP8 windows it stages (staged_names) itself.
        dst_index = {n: i for i, n in enumerate(self.checksum_names if in_engine else self.dst_names)}
        self.staged_names = sorted(self._staged) if in_engine else []
        staged_index = {n: i for i, n in enumerate(self.staged_names)}
        es = plan.element_size
        dst_shapes = plan.engine_shapes(rank)
        self._needs_pool = any(not t.local and rank in (t.sender, t.dst_rank) for b in plan.buckets for t in b)
        self._src_dict, self._dst_dict = src, dst
        self._specs: list[_BucketSpec] = []
        engine_segments: list[list[Segment]] = [[] for _ in self.rounds]
        round_of = [r for r, (start, end) in enumerate(self.rounds) for _ in range(start, end)]
        landed = landing_size = 0
        # The last bucket's received transfers -> their offset in its receive buffer (in the landing buffer), which
        # the bucket after forwards from.
        received: dict[Transfer, int] = {}
        for k, transfers in enumerate(plan.buckets):
            if k == self.rounds[round_of[k]][0]:
                landed = 0  # a round lands at the buffer's start: the engine copied the last one out
            local, packs, unpacks, forwards = [], [], [], []
            staged_local, staged_unpacks = [], []  # in-engine: FP8 windows the trainer assembles itself
            scratched: dict[str, list[Segment]] = {}
            sends: dict[int, list[Transfer]] = {}
            recvs: dict[int, list[Transfer]] = {}
            for t in transfers:
                if t.dst_rank == rank and t.dst_name in self.aliased:
                    assert t.local, (t, "an aliased engine tensor comes from this GPU")
                elif t.dst_rank == rank and t.dst_name in self._direct:
                    assert t.local, (t, "an FP8 tensor quantized from the trainer's comes from this GPU")
                elif t.dst_rank == rank and t.dst_name in self._scratched:
                    scratched.setdefault(t.dst_name, []).append(_segment(
                        t, plan.src_shapes[t.src_name], dst_shapes[t.dst_name], es, src_index[t.src_name], 0))
                elif t.local and t.src_rank == rank and t.dst_name in staged_index:
                    staged_local.append(_segment(t, plan.src_shapes[t.src_name], dst_shapes[t.dst_name], es,
                                                 src_index[t.src_name], staged_index[t.dst_name]))
                elif t.local and t.src_rank == rank:
                    local.append(_segment(t, plan.src_shapes[t.src_name], dst_shapes[t.dst_name], es,
                                          src_index[t.src_name], dst_index[t.dst_name]))
                elif t.sender == rank:
                    sends.setdefault(t.dst_rank, []).append(t)
                elif t.dst_rank == rank:
                    recvs.setdefault(t.sender, []).append(t)
            send_regions, offset = [], 0
            for peer in sorted(sends):
                start = offset
                for t in sends[peer]:
                    if t.via == rank:  # packed as it arrived: one run
                        forwards.append(Segment(0, received[t.feeder()], t.nbytes, 0, offset, t.nbytes, 1, t.nbytes))
                    else:
                        packs.append(_segment(t, plan.src_shapes[t.src_name], plan.engine_shapes(peer)
                                              [t.dst_name], es, src_index[t.src_name], 0, dst_packed=offset))
                    offset += t.nbytes
                send_regions.append((peer, start, offset - start))
            recv_regions, offset = [], 0
            base = landed if in_engine else 0
            received = {}
            for peer in sorted(recvs):
                start = offset
                for t in recvs[peer]:
                    if t.dst_name in staged_index:  # from the landing buffer, where it arrives, into the arena
                        staged_unpacks.append(_segment(t, plan.src_shapes[t.src_name], dst_shapes[t.dst_name], es,
                                                       0, staged_index[t.dst_name], src_packed=base + offset))
                    else:
                        unpacks.append(_segment(t, plan.src_shapes[t.src_name], dst_shapes[t.dst_name], es, 0,
                                                dst_index[t.dst_name], src_packed=offset))
                    received[t] = base + offset
                    offset += t.nbytes
                recv_regions.append((peer, start, offset - start))
            assert max(sum(r[2] for r in send_regions), sum(r[2] for r in recv_regions)) <= plan.bucket_bytes
            if in_engine:
                # Sources of the engine's copy: this rank's trainer tensors, then the landing buffer.
                engine_segments[round_of[k]] += local
                engine_segments[round_of[k]] += [
                    s._replace(src_index=len(self.src_names), src_offset=s.src_offset + landed) for s in unpacks]
                self._specs.append(_BucketSpec(_table(staged_local), _table(packs), _table(staged_unpacks),
                                               send_regions, recv_regions, k % 2, landed, _table(forwards),
                                               fp8_local=[(n, segment_table(x)) for n, x in scratched.items()]))
                landed += offset
                landing_size = max(landing_size, landed)
                continue
            self._specs.append(_BucketSpec(_table(local), _table(packs), _table(unpacks), send_regions, recv_regions,
                                           k % 2, forward=_table(forwards),
                                           fp8_local=[(n, segment_table(x)) for n, x in scratched.items()]))
        self._landing_bytes = landing_size
        self._steps: list[list[tuple[str, Any]]] | None = None
        """In-engine FP8: the hand-over's steps, each what ``refit(step)`` runs before the engine's copy of it."""
        self._fp8_out: dict[str, tuple[int, int]] = {}
        self._fp8_out_bytes = 0
        if in_engine and plan.fp8:
            engine_segments = self._fp8_steps(engine_segments, dst_index, _fp8_schedule(plan, self.rounds, limit,
                                                                                         quantized))
        self._engine_segments = engine_segments
        self.pool: Any = None
        self.landing: torch.Tensor | None = None
        self.fp8_out: torch.Tensor | None = None
        """In-engine FP8: the quantized weights and scales of one step, which the engine's copy moves in."""
        self.staging: torch.Tensor | None = None
        self.scratch: torch.Tensor | None = None
        self._sources: dict[str, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self._scratch_copies: dict[str, Any] = {}
        """The scratch copies of every bucket by FP8 tensor (``_refit_step`` runs each before its quantization)."""
        self.bound = False
        self.bind()
        cuda = self.device.type == "cuda"
        self._streams = [torch.cuda.Stream(self.device) for _ in range(3)] if cuda else None

    def bind(self) -> None:
        """Allocate the staging buffers and compile the copies against the tensors' current addresses (done by
        the constructor; again after ``release``, once the tensors are back on the device, wherever they are)."""
        if self.bound:
            return
        ext = extension()
        # In-engine mode receives into the landing buffer, so only the two send buffers are needed.
        if self._needs_pool:
            self.pool = ext.BufferPool(2 if self.in_engine else 4, self.plan.bucket_bytes, str(self.device))
        if self._landing_bytes:
            self.landing = torch.empty(self._landing_bytes, dtype=torch.uint8, device=self.device)
        self._src = [self._src_dict[n] for n in self.src_names]
        self._sources = self._fp8_sources()
        self._dst = [self._sources[n] if n in self._staged else
                     torch.empty(0, dtype=torch.uint8, device=self.device) if n in self._direct or n in self._scratched
                     else self._dst_dict[n] for n in self.dst_names] if self._dst_dict is not None else \
            [self._sources[n] for n in self.staged_names]
        if self._fp8_out_bytes:
            self.fp8_out = torch.empty(self._fp8_out_bytes, dtype=torch.uint8, device=self.device)
        if self._dst_dict is not None:  # (maybe new) engine tensors: their vocab padding is never sent
            _zero_padding(self._dst_dict, padding_rows(self.plan, self.rank))

        def compiled(table: torch.Tensor | None, srcs: list[torch.Tensor], dsts: list[torch.Tensor],
                     src_names: list[str], dst_names: list[str]) -> Any:
            return None if table is None else ext.SegmentCopy(srcs, dsts, table, src_names, dst_names)

        # Names in the copies' errors (an in-engine rank writes no engine tensors itself, only FP8 windows).
        src, staging = self.src_names, ["staging buffer"]
        dst = self.dst_names if self._dst_dict is not None else [f"{n} (FP8 staging)" for n in self.staged_names]
        received = ["landing buffer"] if self.in_engine else staging
        self.buckets = [_Bucket(
            local=compiled(b.local, self._src, self._dst, src, dst),
            pack=compiled(b.pack, self._src, [self._send(b.buffer)] if b.pack is not None else [], src, staging),
            unpack=compiled(b.unpack, [self._arrived(b)] if b.unpack is not None else [], self._dst, received, dst),
            sends=b.sends, recvs=b.recvs, buffer=b.buffer, landing=b.landing, forward=self._forward(b),
            fp8_local=[(n, ext.SegmentCopy(self._src, [self._sources[n]], table, src, [f"{n} (scratch)"]))
                       for n, table in b.fp8_local])
            for b in self._specs]
        self._scratch_copies = {n: copy for b in self.buckets for n, copy in b.fp8_local}
        self.bound = True

    def _arrived(self, spec: _BucketSpec) -> torch.Tensor:
        """Where a bucket's received bytes are: the landing buffer (in-engine; its table holds the offsets), or
        the bucket's receive buffer."""
        if self.in_engine:
            assert self.landing is not None
            return self.landing
        return self._recv_buffer(spec.buffer)

    def _forward(self, spec: _BucketSpec) -> Any | None:
        """The copy of a bucket's relayed bytes from where they arrived in the bucket before (the landing buffer,
        at the offsets in the table, or the other receive buffer) into its send buffer."""
        if spec.forward is None:
            return None
        if self.in_engine:
            assert self.landing is not None
            arrived = self.landing
        else:
            arrived = self._recv_buffer(1 - spec.buffer)
        return extension().SegmentCopy([arrived], [self._send(spec.buffer)], spec.forward)

    def release(self) -> None:
        """Free the staging and landing buffers and forget every address, so that the trainer's tensors may
        leave the device (megarl.memory.offload) until the next ``bind``."""
        self.buckets, self.pool, self.landing, self._src, self._dst = [], None, None, [], []
        self.fp8_out = None
        self.staging, self.scratch, self._sources, self._scratch_copies = None, None, {}, {}
        self.bound = False

    def _fp8_sources(self) -> dict[str, torch.Tensor]:
        """Each FP8 tensor's window in the trainer's dtype: a view of the staging arena (allocated here), or of
        the trainer's tensor it is byte for byte."""
        if not self.fp8:
            return {}
        assert self.dtype is not None
        element = self.plan.element_size
        if self._staging_bytes:
            self.staging = torch.empty(self._staging_bytes, dtype=torch.uint8, device=self.device)
        if self._scratch_bytes:
            self.scratch = torch.empty(self._scratch_bytes, dtype=torch.uint8, device=self.device)
        out = {}
        for name in self._scratched:
            assert self.scratch is not None
            shape = self.fp8[name].shape
            out[name] = self.scratch.narrow(0, 0, math.prod(shape) * element).view(self.dtype).view(shape)
        for name, offset in self._staged.items():
            assert self.staging is not None
            shape = self.fp8[name].shape
            out[name] = self.staging.narrow(0, offset, math.prod(shape) * element).view(self.dtype).view(shape)
        for name, (src_name, offset) in self._direct.items():
            shape = self.fp8[name].shape
            out[name] = self._src_dict[src_name].view(-1).narrow(0, offset, math.prod(shape)).view(shape)
        return out

    def _quantize_local(self, bucket: _Bucket) -> None:
        """The FP8 tensors this GPU's trainer tensors fill alone in ``bucket``: each copied into the scratch buffer,
        then quantized from it, in order (one stream: the next copy waits for the last quantization)."""
        for name, copy in bucket.fp8_local:
            copy.run()
            self.fp8[name].quantize(self._sources[name], *self._fp8_targets(name))

    def _quantize(self, k: int) -> None:
        """Quantize the FP8 tensors whose last bytes bucket ``k`` wrote into the engine's parameters (in-engine:
        into ``fp8_out``, which the engine's copy of the round reads)."""
        for name in self._quantize_after.get(k, ()):
            self.fp8[name].quantize(self._sources[name], *self._fp8_targets(name))

    def _fp8_targets(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Where FP8 tensor ``name``'s values and scales are written: the engine's parameters, or (in-engine) their
        region of ``fp8_out``."""
        geometry = self.fp8[name]
        if not self.in_engine:
            assert self._dst_dict is not None
            return self._dst_dict[name], self._dst_dict[geometry.scale_name]
        assert self.fp8_out is not None
        values, scales = self._fp8_out[name]
        return (self.fp8_out.narrow(0, values, math.prod(geometry.shape)).view(torch.float8_e4m3fn)
                .view(geometry.shape),
                self.fp8_out.narrow(0, scales, 4 * math.prod(geometry.scale_shape)).view(torch.float32)
                .view(geometry.scale_shape))

    def _fp8_steps(self, round_segments: list[list[Segment]], engine_index: dict[str, int], schedule: _Fp8Schedule
                   ) -> list[list[Segment]]:
        """In-engine FP8: this GPU's steps of ``schedule`` (``_steps``) and the engine's copies per step: each FP8
        tensor's weight and scales out of ``fp8_out`` in the step that quantizes it, a round's other engine copies with
        its last step, when all of its buckets have landed (the landing buffer holds them until the next round
        lands)."""
        source = len(self.src_names) + (1 if self._landing_bytes else 0)  # after the landing buffer
        buckets = [[[arg for op, arg in ops if op == "io"] for ops in steps] for steps in schedule.ops]
        assert all(b == buckets[self.rank] for b in buckets), "a GPU whose steps differ hangs the engines' copies"
        self._steps = schedule.ops[self.rank]
        self._fp8_out = schedule.out[self.rank]
        segments: list[list[Segment]] = [[] for _ in self._steps]
        for step, ops in enumerate(self._steps):
            for name in (arg for op, arg in ops if op == "fp8"):
                geometry = self.fp8[name]
                values, scales = math.prod(geometry.shape), 4 * math.prod(geometry.scale_shape)
                for dst, offset, nbytes in zip((name, geometry.scale_name), self._fp8_out[name], (values, scales),
                                               strict=True):
                    segments[step].append(Segment(source, offset, nbytes, engine_index[dst], 0, nbytes, 1, nbytes))
                self._fp8_out_bytes = max(self._fp8_out_bytes, self._fp8_out[name][1] + _aligned_bytes(scales))
            if step + 1 == len(schedule.rounds) or schedule.rounds[step + 1] != schedule.rounds[step]:
                segments[step] += round_segments[schedule.rounds[step]]
        return segments

    @property
    def staging_bytes(self) -> int:
        """Memory the FP8 quantization takes besides the engine's parameters: the staging arena (the windows of the
        FP8 tensors in flight at once) and the scratch buffer (the largest filled by this GPU alone), in the
        trainer's dtype."""
        return self._staging_bytes + self._scratch_bytes

    def _send(self, buf: int) -> torch.Tensor:
        assert self.pool is not None
        return self.pool.buffer(buf)

    def _recv_buffer(self, buf: int) -> torch.Tensor:
        assert self.pool is not None
        return self.pool.buffer(2 + buf)

    def _recv(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.landing is not None:
            assert self.landing is not None
            return self.landing[bucket.landing:]
        return self._recv_buffer(bucket.buffer)

    def _check(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor] | None,
               dtype: torch.dtype | None) -> None:
        plan, rank = self.plan, self.rank
        expected_src = {t.src_name for b in plan.buckets for t in b if t.src_rank == rank}
        check_tensors(src, {n: plan.src_shapes[n] for n in expected_src}, plan.element_size, f"trainer, rank {rank}")
        held = one_dtype(src, f"trainer, rank {rank}")
        if held is not None and dtype is not None and held != dtype:
            raise UserError(f"trainer, rank {rank}: the tensors to hand over are {held}, not the {dtype} expected")
        self.dtype = held or dtype
        if dst is not None:
            fp8 = plan.fp8_tensors(rank)
            check_tensors(dst, {n: s for n, s in plan.engine_shapes(rank).items() if n not in fp8}, plan.element_size,
                          f"engine, rank {rank}")
            check_fp8_tensors(dst, fp8, f"engine, rank {rank}")
            for name in sorted(plan.engine_shapes(rank)):
                if name in fp8:
                    continue
                if self.dtype is not None and dst[name].dtype != self.dtype:
                    raise UserError(f"engine, rank {rank}: tensor `{name}` is {dst[name].dtype}, but the trainer "
                                    f"hands over {self.dtype}; the bits would be read as other numbers. Give the "
                                    "engine the trainer's dtype (model.dtype).")

    def engine_copy(self) -> EngineCopy:
        """The engine rank's share of the refit on this GPU (``in_engine`` mode): from ``sources`` (this
        rank's trainer tensors, then the landing buffer) into its parameters, round r after ``refit(r)``."""
        assert self.in_engine
        self.bind()
        shapes = self.plan.engine_shapes(self.rank)
        bounds = [0]
        for segments in self._engine_segments:
            bounds.append(bounds[-1] + len(segments))
        rows = [s for segments in self._engine_segments for s in segments]
        scales = {f.scale_name: f.scale_shape for f in self.fp8.values()}
        dtypes = {n: "float8_e4m3fn" for n in self.fp8} | dict.fromkeys(scales, "float32")
        return EngineCopy(sources=self._src + ([self.landing] if self.landing is not None else [])
                          + ([self.fp8_out] if self.fp8_out is not None else []),
                          dst_names=self.checksum_names, dst_shapes=shapes | scales, dtype=self._dtype_name(),
                          table=segment_table(rows), zero_rows=padding_rows(self.plan, self.rank), rounds=bounds,
                          dtypes=dtypes, fp8_block=next((g.block[0] for g in self.fp8.values()), 0))

    def _dtype_name(self) -> str:
        if self.dtype is None:
            raise UserError(f"rank {self.rank} holds no trainer tensor, so the dtype its engine must hold is unknown: "
                            "pass the trainer's dtype to its Resharder")
        return str(self.dtype).removeprefix("torch.")

    @property
    def num_rounds(self) -> int:
        """The hand-over's rounds: ``refit(r)`` then the engine's copy of round r, for each in order."""
        return len(self._steps) if self._steps is not None else len(self.rounds)

    @property
    def landing_bytes(self) -> int:
        """Size of the landing buffer (``in_engine``): the most this rank receives in one round."""
        return self._landing_bytes

    @torch.no_grad()
    def expected_checksums(self) -> torch.Tensor:
        """int64 [len(dst_names), 2]: what this GPU's engine rank must report after the refit of the trainer's
        current weights (megarl.reshard.verify; collective over the Resharder's group)."""
        return expected_checksums(self.plan, self.rank, self._src_dict, self.group, self.device, self.dtype)

    def verify(self, engine: ReportsChecksums, handover: int) -> None:
        """rollout.verify_every: every engine rank's parameters against the actor's weights, by checksum; raises
        HandoverMismatch naming what differs on every GPU."""
        start = time.perf_counter()
        names = self.checksum_names
        bad = mismatched(names, self.expected_checksums(), engine.checksums(len(names)))
        everyone: list[Any] = [bad]
        if spans_processes(self.plan, self.group):
            everyone = [None] * self.plan.num_gpus
            dist.all_gather_object(everyone, bad, group=self.group)
        check_reports(handover, everyone)
        if self.rank == 0:
            print(f"megarl: hand-over {handover} verified: the engine's parameters match the actor's weights on "
                  f"every GPU ({time.perf_counter() - start:.2f} s)", flush=True)

    def _p2p(self, bucket: _Bucket) -> list[Any]:
        ops = [dist.P2POp(dist.isend, self._send(bucket.buffer).narrow(0, off, n), group=self.group, group_peer=peer)
               for peer, off, n in bucket.sends]
        ops += [dist.P2POp(dist.irecv, self._recv(bucket).narrow(0, off, n), group=self.group, group_peer=peer)
                for peer, off, n in bucket.recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    @torch.no_grad()
    def refit(self, round: int | None = None) -> None:
        """Copy the trainer's current weights into the engine tensors (round ``round`` of them; None: all, where
        there is one). On GPU the caller's stream waits for the result; nothing blocks the host except on CPU."""
        if round is None:
            assert self.num_rounds == 1, "the landing buffer holds one round at a time: refit(r) for each"
            round = 0
        self.bind()
        if self._steps is not None:
            self._refit_step(self._steps[round])
            return
        start, end = self.rounds[round]
        buckets = self.buckets[start:end]
        if self._streams is None:
            for k, bucket in enumerate(buckets):
                self._bucket_io(bucket)
                self._quantize_local(bucket)
                self._quantize(start + k)
            return
        self._refit_streams(buckets, start)

    def _refit_step(self, ops: list[tuple[str, Any]]) -> None:
        """One step of an in-engine FP8 hand-over, in order on the current stream: a bucket's copies into the
        staging arena and its transfers, then each quantization into ``fp8_out`` (a scratched tensor copied into
        the scratch buffer first)."""
        for op, arg in ops:
            if op == "io":
                self._bucket_io(self.buckets[arg])
                continue
            if arg in self._scratch_copies:
                self._scratch_copies[arg].run()
            self.fp8[arg].quantize(self._sources[arg], *self._fp8_targets(arg))

    def _bucket_io(self, bucket: _Bucket) -> None:
        """A bucket's copies and transfers one after the other (CPU, and in-engine FP8 steps): its local copies,
        packing, relayed bytes, the transfers, unpacking."""
        for copy in (bucket.local, bucket.pack, bucket.forward):
            if copy is not None:
                copy.run()
        for work in self._p2p(bucket):
            work.wait()
        if bucket.unpack is not None:
            bucket.unpack.run()

    def _refit_streams(self, buckets: list[_Bucket], first: int) -> None:
        pack_s, comm_s, unpack_s = self._streams  # type: ignore[misc]
        caller = torch.cuda.current_stream(self.device)
        for s in (pack_s, comm_s, unpack_s):
            s.wait_stream(caller)  # the trainer's last optimizer step must be done
        sent: list[list[Any]] = []
        unpacked: list[torch.cuda.Event] = []
        for k, bucket in enumerate(buckets):
            with torch.cuda.stream(pack_s):
                if k >= 2:
                    for work in sent[k - 2]:
                        work.wait()  # the send buffer this bucket reuses has left the GPU
                if self.fp8 and k >= 1:
                    pack_s.wait_event(unpacked[k - 1])  # the staging regions freed by the last quantization
                if bucket.local is not None:
                    bucket.local.run()
                self._quantize_local(bucket)
                if bucket.pack is not None:
                    bucket.pack.run()
                if bucket.forward is not None:
                    # The bytes to forward arrived in the bucket before. At a round's first bucket they arrived in
                    # the last round, which the caller's stream (waited for above) has seen through.
                    for work in sent[k - 1] if k else []:
                        work.wait()
                    bucket.forward.run()
                packed = torch.cuda.Event()
                packed.record(pack_s)
            with torch.cuda.stream(comm_s):
                comm_s.wait_event(packed)
                if k >= 2:
                    comm_s.wait_event(unpacked[k - 2])  # the receive buffer was drained
                works = self._p2p(bucket)
            sent.append(works)
            with torch.cuda.stream(unpack_s):
                for work in works:
                    work.wait()
                if bucket.unpack is not None:
                    bucket.unpack.run()
                if self._quantize_after.get(first + k):
                    unpack_s.wait_event(packed)  # this bucket's local copies into the staging arena
                    self._quantize(first + k)
                done = torch.cuda.Event()
                done.record(unpack_s)
                unpacked.append(done)
        for s in (pack_s, comm_s, unpack_s):
            caller.wait_stream(s)

    @torch.no_grad()
    def refit_phases(self) -> dict[str, float]:
        """One refit with the phases serialized and timed (ms on this rank): local, pack, forward (relayed
        bytes), transfer, unpack.

        For the benchmark's breakdown only: serializing removes the overlap that ``refit`` has.
        """
        cuda = self.device.type == "cuda"
        totals = dict.fromkeys(("local", "pack", "forward", "transfer", "unpack"), 0.0)

        def timed(phase: str, fn: Any) -> None:
            if cuda:
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(self.device)
            totals[phase] += (time.perf_counter() - start) * 1e3

        for k, bucket in enumerate(self.buckets):
            if bucket.local is not None:
                timed("local", bucket.local.run)
            if bucket.fp8_local:
                timed("local", lambda b=bucket: self._quantize_local(b))  # FP8: counted with the local copies
            if bucket.pack is not None:
                timed("pack", bucket.pack.run)
            if bucket.forward is not None:
                timed("forward", bucket.forward.run)
            timed("transfer", lambda b=bucket: [w.wait() for w in self._p2p(b)])
            if bucket.unpack is not None:
                timed("unpack", bucket.unpack.run)
            if self._quantize_after.get(k):
                timed("unpack", lambda k=k: self._quantize(k))  # FP8: counted with the unpack it follows
        return totals

    @property
    def pool_bytes(self) -> int:
        return 0 if self.pool is None else int(self.pool.total_bytes)


def landing_rounds(plan: Plan, limit: int) -> list[tuple[int, int]]:
    """Consecutive buckets grouped so that no rank receives more than ``limit`` bytes from other GPUs in one
    group (0: no limit); [start, end) bucket ranges, the same on every rank."""
    assert limit == 0 or limit >= plan.bucket_bytes, "a bucket must fit the landing buffer"
    rounds: list[tuple[int, int]] = []
    start, received = 0, dict[int, int]()
    for k, transfers in enumerate(plan.buckets):
        incoming: dict[int, int] = {}
        for t in transfers:
            if not t.local:
                incoming[t.dst_rank] = incoming.get(t.dst_rank, 0) + t.nbytes
        if limit and any(received.get(r, 0) + n > limit for r, n in incoming.items()):
            rounds.append((start, k))
            start, received = k, {}
        for r, n in incoming.items():
            received[r] = received.get(r, 0) + n
    rounds.append((start, len(plan.buckets)))
    return rounds


def _aligned_bytes(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class _Fp8Schedule(NamedTuple):
    """An in-engine FP8 hand-over's steps on every GPU (``_fp8_schedule``)."""

    rounds: list[int]
    """The landing round of each step."""
    ops: list[list[list[tuple[str, Any]]]]
    """Per GPU, per step: bucket transfers ("io", k) and quantizations into ``fp8_out`` ("fp8", name), in order."""
    out: list[dict[str, tuple[int, int]]]
    """Per GPU: each FP8 tensor's offsets of its weight and its scales in ``fp8_out``."""


def _fp8_schedule(plan: Plan, rounds: list[tuple[int, int]], limit: int, quantized: list[dict[int, list[str]]]
                  ) -> _Fp8Schedule:
    """In-engine FP8: the hand-over cut into steps on every GPU at once, each GPU's output of a step fitting its
    ``fp8_out``; ``quantized``: per GPU, the tensors quantized after each bucket, in order (``_quantizations``).

    A landing round starts a step; within one, a quantization that would take any GPU's ``fp8_out`` past ``limit``
    (0: no limit) starts the next step on every GPU, so that it holds one step's FP8 weights and scales however many
    the round finishes (at TP1 every transfer is local and one bucket holds the model). The engines' copy between two
    steps waits for every GPU of an engine, so every GPU must run the same steps with the same buckets: cut by its own
    output alone, a GPU would wait there for bytes its peer sends only in a later step. A tensor is quantized right
    after its last bucket, as in the other mode, before a later bucket reuses its staging region."""
    step_rounds: list[int] = []
    ops: list[list[list[tuple[str, Any]]]] = [[] for _ in quantized]
    out: list[dict[str, tuple[int, int]]] = [{} for _ in quantized]
    used = [0] * len(quantized)

    def cut(r: int) -> None:
        step_rounds.append(r)
        for steps in ops:
            steps.append([])
        used[:] = [0] * len(used)

    for r, (start, end) in enumerate(rounds):
        cut(r)
        for k in range(start, end):
            pending = [deque(q.get(k, ())) for q in quantized]
            for steps in ops:
                steps[-1].append(("io", k))
            while True:
                for g, names in enumerate(pending):
                    while names:
                        geometry = plan.fp8_tensors(g)[names[0]]
                        values = _aligned_bytes(math.prod(geometry.shape))
                        need = values + _aligned_bytes(4 * math.prod(geometry.scale_shape))
                        if limit and used[g] and used[g] + need > limit:
                            break
                        name = names.popleft()
                        out[g][name] = (used[g], used[g] + values)
                        used[g] += need
                        ops[g][-1].append(("fp8", name))
                if not any(pending):
                    break
                cut(r)
    return _Fp8Schedule(step_rounds, ops, out)


def padding_rows(plan: Plan, rank: int) -> dict[str, int]:
    """Engine vocab tensors of ``rank`` whose rows from the given index on (the vocab padding) are never sent."""
    covered: dict[str, int] = {}
    for b in plan.buckets:
        for t in b:
            if t.dst_rank == rank and t.dim == 0:
                covered[t.dst_name] = max(covered.get(t.dst_name, 0), t.dst_offset + t.length)
    shapes = plan.engine_shapes(rank)
    return {name: covered.get(name, 0) for name in ("model.embed_tokens.weight", "lm_head.weight")
            if name in shapes and covered.get(name, 0) < shapes[name][0]}


def _table(segments: list[Segment]) -> torch.Tensor | None:
    return segment_table(segments) if segments else None


@torch.no_grad()
def _zero_padding(dst: dict[str, torch.Tensor], rows: dict[str, int]) -> None:
    for name, start in rows.items():
        dst[name][start:].zero_()


def check_tensors(given: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], element_size: int,
                  side: str) -> None:
    """Every planned tensor is present, contiguous, and has the planned shape and element size."""
    for name in sorted(shapes):
        if name not in given:
            raise UserError(f"{side}: tensor `{name}` is missing; the model does not match the resharding plan "
                            "(check the model config and parallel layout).")
        tensor = given[name]
        if tuple(tensor.shape) != tuple(shapes[name]) or tensor.element_size() != element_size:
            raise UserError(f"{side}: tensor `{name}` has shape {list(tensor.shape)} and {tensor.element_size()}-"
                            f"byte elements; the plan expects {list(shapes[name])} and {element_size}-byte "
                            "elements. The model and the trainer/engine layout disagree.")
        if not tensor.is_contiguous():
            raise UserError(f"{side}: tensor `{name}` is not contiguous.")


def check_fp8_tensors(given: dict[str, torch.Tensor], fp8: dict[str, Fp8Tensor], side: str) -> None:
    """Every FP8 engine tensor of the plan is present as float8_e4m3fn ``weight`` and float32 ``weight_scale_inv``
    of the planned shapes, contiguous (rollout.weight_dtype = fp8)."""
    for name in sorted(fp8):
        geometry = fp8[name]
        for n, shape, dtype in ((name, geometry.shape, torch.float8_e4m3fn),
                                (geometry.scale_name, geometry.scale_shape, torch.float32)):
            tensor = given.get(n)
            if tensor is None:
                raise UserError(f"{side}: tensor `{n}` is missing; rollout.weight_dtype = fp8 needs the engine's "
                                "FP8 linear layers (weight and weight_scale_inv) as the plan lays them out.")
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype or not tensor.is_contiguous():
                raise UserError(f"{side}: tensor `{n}` is {tensor.dtype} of shape {list(tensor.shape)}"
                                f"{'' if tensor.is_contiguous() else ', not contiguous'}; rollout.weight_dtype = "
                                f"fp8 needs {dtype} of shape {list(shape)}, contiguous ({geometry.block[0]} x "
                                f"{geometry.block[1]} blocks).")


def fp8_routes(plan: Plan, rank: int) -> tuple[dict[str, tuple[str, int]], set[str], set[str]]:
    """How GPU ``rank`` quantizes its FP8 engine tensors: (direct: name -> (trainer tensor, element offset), those
    read straight from one trainer tensor of this GPU; scratched: those this GPU's trainer tensors fill alone within one
    bucket, copied into the scratch buffer; staged: the rest, assembled in the staging arena)."""
    return _fp8_routes(plan)[rank]


def _fp8_routes(plan: Plan) -> list[tuple[dict[str, tuple[str, int]], set[str], set[str]]]:
    """``fp8_routes`` of every GPU, in one pass over the plan."""
    fp8 = [plan.fp8_tensors(g) for g in range(plan.num_gpus)]
    if not any(fp8):
        return [({}, set(), set()) for _ in fp8]
    direct = [{n: a for n, a in found.items() if n in fp8[g]} for g, found in enumerate(aliases(plan))]
    into: list[dict[str, list[tuple[int, Transfer]]]] = [{} for _ in fp8]
    for k, bucket in enumerate(plan.buckets):
        for t in bucket:
            g = t.dst_rank
            if t.dst_name in fp8[g] and t.dst_name not in direct[g]:
                into[g].setdefault(t.dst_name, []).append((k, t))
    routes = []
    for g, by_name in enumerate(into):
        scratched = {n for n, ts in by_name.items() if len({k for k, _ in ts}) == 1 and all(
            t.local and t.src_rank == g for _, t in ts)}
        routes.append((direct[g], scratched, set(by_name) - scratched))
    return routes


def _quantizations(plan: Plan, routes: list[tuple[dict[str, tuple[str, int]], set[str], set[str]]]
                   ) -> list[dict[int, list[str]]]:
    """Per GPU (``routes``: ``_fp8_routes``): bucket -> the FP8 tensors quantized right after its transfers, in order:
    those the GPU's trainer tensors fill alone in it (scratched), then those whose last bytes it brings."""
    scratched_in: list[dict[int, dict[str, None]]] = [{} for _ in routes]
    brought: list[dict[int, dict[str, None]]] = [{} for _ in routes]
    last: list[dict[str, int]] = [{} for _ in routes]
    for k, bucket in enumerate(plan.buckets):
        for t in bucket:
            g, name = t.dst_rank, t.dst_name
            direct, scratched, staged = routes[g]
            if name in scratched:
                scratched_in[g].setdefault(k, {})[name] = None
            elif name in direct or name in staged:
                brought[g].setdefault(k, {})[name] = None
                last[g][name] = k
    out: list[dict[int, list[str]]] = []
    for g in range(len(routes)):
        order = {k: [*scratched_in[g].get(k, ()), *(n for n in brought[g].get(k, ()) if last[g][n] == k)]
                 for k in sorted(scratched_in[g].keys() | brought[g].keys())}
        out.append({k: names for k, names in order.items() if names})
    return out


def fp8_buffer_bytes(plan: Plan, rank: int, landing_bytes: int | None) -> int:
    """The most memory an in-engine FP8 hand-over takes on GPU ``rank`` beside the engine's parameters (the memory
    plan's count): the staging arena, the scratch buffer, and ``fp8_out``, whose steps stop at the landing limit
    (``landing_bytes``; None: twice a bucket, 0: none) unless one tensor alone is larger."""
    fp8 = plan.fp8_tensors(rank)
    if not fp8:
        return 0
    _, scratched, staged = fp8_routes(plan, rank)
    needs = [_aligned_bytes(math.prod(g.shape)) + _aligned_bytes(4 * math.prod(g.scale_shape)) for g in fp8.values()]
    limit = 2 * plan.bucket_bytes if landing_bytes is None else landing_bytes
    out = min(sum(needs), max(limit, max(needs))) if limit else sum(needs)
    return _scratch_bytes(plan, rank, scratched) + _staging(plan, rank, staged)[1] + out


def _scratch_bytes(plan: Plan, rank: int, scratched: set[str]) -> int:
    fp8 = plan.fp8_tensors(rank)
    return max((math.prod(fp8[n].shape) * plan.element_size for n in scratched), default=0)


def _staging(plan: Plan, rank: int, names: set[str]) -> tuple[dict[str, int], int]:
    """Byte offsets in one staging arena for the trainer-dtype windows of FP8 tensors ``names`` (of GPU ``rank``),
    and the arena's size: a tensor's region is live from its first bucket to its last, and tensors whose buckets do
    not overlap share memory (first fit), so the arena holds the tensors in flight at once."""
    if not names:
        return {}, 0
    live: dict[str, list[int]] = {}
    for k, bucket in enumerate(plan.buckets):
        for t in bucket:
            if t.dst_rank == rank and t.dst_name in names:
                live.setdefault(t.dst_name, [k, k])[1] = k
    fp8 = plan.fp8_tensors(rank)
    placed: list[tuple[int, int, int, int]] = []  # first bucket, last bucket, offset, bytes
    offsets: dict[str, int] = {}
    for name in sorted(live, key=lambda n: (live[n][0], n)):
        first, last = live[name]
        nbytes = -(-math.prod(fp8[name].shape) * plan.element_size // 256) * 256
        busy = sorted((o, o + b) for f, la, o, b in placed if not (la < first or last < f))
        offset = 0
        for lo, hi in busy:
            if offset + nbytes <= lo:
                break
            offset = max(offset, hi)
        placed.append((first, last, offset, nbytes))
        offsets[name] = offset
    return offsets, max(o + b for _, _, o, b in placed)


def one_dtype(tensors: dict[str, torch.Tensor], side: str) -> torch.dtype | None:
    """The one dtype of ``tensors`` (None for none): the copy moves bits, so bf16 and fp16 of the same size must not
    mix unnoticed."""
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    if len(dtypes) > 1:
        raise UserError(f"{side}: the tensors to hand over mix dtypes {dtypes}; the hand-over moves bits unchanged "
                        "and needs one dtype (model.dtype).")
    return next(iter(tensors.values())).dtype if tensors else None


def engine_tensor_allocations(plan: Plan, rank: int, dtype: torch.dtype, device: torch.device
                              ) -> dict[str, torch.Tensor]:
    """Fresh engine-layout tensors for ``rank`` (tests, benchmarks, and engines without their own); with
    ``plan.fp8``, its FP8 tensors as float8_e4m3fn weights and float32 ``weight_scale_inv``, SGLang's names."""
    shapes, fp8 = plan.engine_shapes(rank), plan.fp8_tensors(rank)
    out = {}
    for name, shape in shapes.items():
        if name in fp8:
            out[name] = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
            out[fp8[name].scale_name] = torch.empty(fp8[name].scale_shape, dtype=torch.float32, device=device)
        else:
            out[name] = torch.empty(shape, dtype=dtype, device=device)
    return out


@dataclass
class FlatBucket:
    """Engine tensors laid out back to back in one flat buffer, for engines that take whole buckets
    (one IPC handle or one ``flattened_bucket`` payload) instead of being written in place."""

    buffer: torch.Tensor
    tensors: dict[str, torch.Tensor]
    """Views into ``buffer`` by engine name; pass them (merged over buckets) as the Resharder's ``dst``."""


def allocate_flat_buckets(plan: Plan, rank: int, dtype: torch.dtype, device: torch.device,
                          max_bytes: int = 512 * 2**20) -> list[FlatBucket]:
    """Engine-layout tensors of ``rank`` as views into flat buffers of at most ``max_bytes`` each
    (a larger tensor gets a buffer of its own), in forward order, each tensor 256-byte aligned."""
    shapes = plan.engine_shapes(rank)
    element = torch.empty((), dtype=dtype).element_size()
    groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = -(-math.prod(shape) * element // 256) * 256
        if groups[-1] and used + nbytes > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, shape, used))
        used += nbytes
    out = []
    for group in groups:
        end = group[-1][2] + math.prod(group[-1][1]) * element
        buffer = torch.empty(end, dtype=torch.uint8, device=device)
        tensors = {name: buffer.narrow(0, off, math.prod(shape) * element).view(dtype).view(shape)
                   for name, shape, off in group}
        out.append(FlatBucket(buffer, tensors))
    return out

"""What a refit moves and when: transfers (a run of rows from a trainer tensor into an engine tensor) and the
buckets they are grouped into, so that no GPU sends or receives more than a bucket's bytes at a time, of them no
more across nodes than the network moves while NVLink moves a bucket. ``megarl.reshard.planner`` chooses the
transfers; this module packs them."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Transfer:
    """Copy ``length`` rows (along ``dim``) of trainer tensor ``src_name`` on ``src_rank``, starting at
    ``src_offset``, into engine tensor ``dst_name`` on ``dst_rank`` at ``dst_offset``.

    ``src_rank`` is always the trainer rank whose tensor holds the bytes (the origin). A relayed transfer
    (``via`` >= 0) is sent by GPU ``via`` instead, on ``dst_rank``'s node and of its engine rank, which
    received the same bytes at the same place of its own engine tensor (``feeder()``) in the bucket before."""

    src_rank: int
    src_name: str
    dst_rank: int
    dst_name: str
    dim: int
    src_offset: int
    dst_offset: int
    length: int
    nbytes: int
    via: int = -1

    @property
    def sender(self) -> int:
        """The GPU whose bytes go out: the forwarding GPU of a relayed transfer, else the origin."""
        return self.src_rank if self.via < 0 else self.via

    @property
    def local(self) -> bool:
        return self.via < 0 and self.src_rank == self.dst_rank

    def feeder(self) -> Transfer:
        """The transfer into ``via`` whose bytes a relayed transfer forwards."""
        assert self.via >= 0, self
        return replace(self, dst_rank=self.via, via=-1)


Unit = tuple[Transfer, list[Transfer]]
"""A transfer and the relayed transfers that forward its bytes (none for most)."""


def row_bytes(shape: tuple[int, ...], dim: int, element_size: int) -> int:
    """Bytes per unit of length along ``dim``: a row for dim 0, a column for dim 1."""
    return (math.prod(shape[1:]) if dim == 0 else shape[0]) * element_size


def split_transfer(t: Transfer, max_bytes: int) -> list[Transfer]:
    per_unit = t.nbytes // t.length
    step = max(1, max_bytes // per_unit)
    return [replace(t, src_offset=t.src_offset + i, dst_offset=t.dst_offset + i, length=min(step, t.length - i),
                    nbytes=min(step, t.length - i) * per_unit)
            for i in range(0, t.length, step)]


def bucketize(units_by_group: list[list[Unit]], bucket_bytes: int, network_bytes: int, gpus_per_node: int
              ) -> list[list[Transfer]]:
    """Buckets in which no GPU sends or receives more than ``bucket_bytes``, of them at most ``network_bytes``
    across nodes (what the network moves while NVLink moves a bucket), filled first-fit.

    Each cross-GPU piece goes into the first bucket with room at both of its ends, so that pieces
    moving in opposite directions (a pipeline stage's layers to the other stage's GPUs, and back)
    share buckets and both directions of every link stay busy. Layer order only decides who comes
    first. A piece that is relayed goes into the first bucket k with room for it whose next bucket
    has room for its relays: the forwarding GPU reads the bytes from where bucket k received them,
    which stays intact until bucket k + 2 (or the next landing round) receives. Local copies need no
    buffer: each joins the bucket where its GPU has copied the fewest bytes so far, to run beside the
    transfers.
    """
    limit = bucket_bytes
    filling = _Filling(limit, network_bytes, gpus_per_node)
    local: list[Transfer] = []
    for units in units_by_group:
        for whole, relays in units:
            if whole.local:
                local.append(whole)
                continue
            # The forwarding GPU sends a piece to every relayed GPU in one bucket.
            step = limit // max(1, len(relays))
            if whole.sender // gpus_per_node != whole.dst_rank // gpus_per_node:
                step = min(step, network_bytes)
            legs = [split_transfer(t, step) for t in relays]
            for i, piece in enumerate(split_transfer(whole, step)):
                filling.place(piece, [leg[i] for leg in legs])
    buckets = filling.buckets or [[]]
    copied: dict[int, list[int]] = defaultdict(lambda: [0] * len(buckets))
    for t in local:
        k = min(range(len(buckets)), key=copied[t.dst_rank].__getitem__)
        buckets[k].append(t)
        copied[t.dst_rank][k] += t.nbytes
    return [b for b in buckets if b]


class _Filling:
    """Buckets being filled, with the bytes each GPU sends and receives in each, in all and across nodes."""

    def __init__(self, limit: int, network_limit: int, gpus_per_node: int) -> None:
        self.limit, self.network_limit, self.node = limit, network_limit, gpus_per_node
        self.buckets: list[list[Transfer]] = []
        self.send: list[dict[int, int]] = []
        self.recv: list[dict[int, int]] = []
        self.network: list[dict[tuple[int, str], int]] = []
        """(GPU, "out" or "in") -> bytes across nodes."""
        # Buckets before first_send[g] (first_recv[g]) are full for GPU g in that direction (budgets only grow).
        self.first_send: dict[int, int] = defaultdict(int)
        self.first_recv: dict[int, int] = defaultdict(int)
        self.placed: dict[tuple[tuple[int, int, int], ...], int] = {}
        """Where the last piece of the same ends and sizes (and relays') went: none of them fits before it."""

    def place(self, piece: Transfer, relays: list[Transfer]) -> None:
        """``piece`` into the first bucket with room for it, its ``relays`` (if any) into the bucket after."""
        # Budgets only fill, so buckets skipped for a piece stay closed to one of the same ends and size: one
        # sender feeding many engine GPUs would otherwise rescan every bucket for each of its pieces.
        shape = tuple((t.sender, t.dst_rank, t.nbytes) for t in (piece, *relays))
        k = max(self.placed.get(shape, 0), self.first_send[piece.sender], self.first_recv[piece.dst_rank])
        while not (self._fits(k, [piece]) and (not relays or self._fits(k + 1, relays))):
            k += 1
        self.placed[shape] = k
        self._add(k, piece)
        for t in relays:
            self._add(k + 1, t)

    def _fits(self, k: int, transfers: list[Transfer]) -> bool:
        if k >= len(self.buckets):
            return True  # a new bucket takes any piece: pieces are split to fit one
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        network: dict[tuple[int, str], int] = defaultdict(int)
        for t in transfers:
            send[t.sender] += t.nbytes
            recv[t.dst_rank] += t.nbytes
            if self._crosses(t):
                network[t.sender, "out"] += t.nbytes
                network[t.dst_rank, "in"] += t.nbytes
        return (all(self.send[k].get(g, 0) + n <= self.limit for g, n in send.items())
                and all(self.recv[k].get(g, 0) + n <= self.limit for g, n in recv.items())
                and all(self.network[k].get(end, 0) + n <= self.network_limit for end, n in network.items()))

    def _crosses(self, t: Transfer) -> bool:
        return t.sender // self.node != t.dst_rank // self.node

    def _add(self, k: int, t: Transfer) -> None:
        while len(self.buckets) <= k:
            self.buckets.append([])
            self.send.append(defaultdict(int))
            self.recv.append(defaultdict(int))
            self.network.append(defaultdict(int))
        self.buckets[k].append(t)
        self.send[k][t.sender] += t.nbytes
        self.recv[k][t.dst_rank] += t.nbytes
        if self._crosses(t):
            self.network[k][t.sender, "out"] += t.nbytes
            self.network[k][t.dst_rank, "in"] += t.nbytes
        g, h = t.sender, t.dst_rank
        while self.first_send[g] < len(self.buckets) and self.send[self.first_send[g]][g] >= self.limit:
            self.first_send[g] += 1
        while self.first_recv[h] < len(self.buckets) and self.recv[self.first_recv[h]][h] >= self.limit:
            self.first_recv[h] += 1

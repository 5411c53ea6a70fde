"""The last step of a refit run by the engine itself: one kernel from trainer memory into its parameters.

Engines with a sleep mode allocate their weights through CUDA virtual memory (SGLang's torch memory
saver, vLLM's CuMemAllocator), which cannot be exported by CUDA IPC; the trainer's tensors come
from torch's caching allocator, which can. So the engine rank opens the trainer tensors on its GPU
(``attach``) and compiles a ``SegmentCopy`` from them into its parameters for each round of the
hand-over (the trainer's landing buffer holds one round of what other GPUs send); every weight update
after that replays the kernels, one call per round (``apply``): no per-tensor IPC, no staging copy, and
the parameters stay at the addresses the engine's CUDA graphs captured (the memory saver maps them
back at the same addresses after a sleep). When the trainer moves its weights off the GPU during
rollout, the engine drops its mappings first (``detach``) and the trainer attaches again after. With
``rollout.verify_every`` the engine also reports checksums of its parameters (``checksum_message``).

Wire format: engines such as SGLang accept only ``(name, tensor)`` pairs from outside (their
unpickler allows no other classes), so an ``EngineCopy`` travels as named tensors (``to_wire``):
its metadata as a JSON byte tensor, its segment table, then its sources. This module runs inside the
engine process: it imports torch, megarl.reshard.kernels and megarl.reshard.verify only.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import torch

from megarl.reshard.kernels import SegmentCopy, make_segment_copy
from megarl.reshard.verify import tensor_checksum

PREFIX = "megarl.handover."


@dataclass
class EngineCopy:
    """One engine rank's copy: segments (megarl.reshard.kernels.Segment rows) from ``sources`` (trainer
    tensors on its GPU) into its parameters ``dst_names`` (destination index = position in that list)."""

    sources: list[torch.Tensor]
    dst_names: list[str]
    dst_shapes: dict[str, tuple[int, ...]]
    """Every engine parameter of this rank the refit writes, with its shape (checked when attached)."""
    dtype: str
    """The dtype the engine's parameters must hold (``torch`` attribute name): the trainer's own, whose bits the
    copy moves unchanged and both sides' checksums hash (``dtypes`` names the exceptions). An engine holding another
    dtype would read the bits as different numbers with every checksum equal, so it is refused when attached."""
    table: torch.Tensor
    """int64 [num_segments, 8] CPU segment table."""
    zero_rows: dict[str, int]
    """Engine vocab tensors whose rows from this index on are padding: zeroed on every update, since
    an engine's memory after a sleep holds no defined values."""
    rounds: list[int]
    """Row bounds of the rounds in ``table``: round r is rows [rounds[r], rounds[r + 1])."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Parameters that hold another dtype than ``dtype``: with rollout.weight_dtype = fp8, the linear layers'
    float8_e4m3fn weights and their float32 ``weight_scale_inv``, which the trainer quantized and the copy moves as
    bytes."""
    fp8_block: int = 0
    """The FP8 tensors' block (rollout.fp8_block; 0 without any), for the engine's errors."""

    def to_wire(self, key: str, num_sources: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """Named tensors carrying this copy; ``key`` names the attachment for later ``apply`` calls.
        ``num_sources`` pads the sources with placeholders (an engine over several GPUs takes the same
        names from every rank)."""
        meta = {"key": key, "dst_names": self.dst_names, "dst_shapes": self.dst_shapes, "rounds": self.rounds,
                "dtype": self.dtype, "zero_rows": self.zero_rows, "num_sources": len(self.sources),
                "dtypes": self.dtypes, "fp8_block": self.fp8_block}
        device = self.sources[0].device if self.sources else torch.device("cpu")
        encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        # Small tensors travel on the GPU too: CUDA tensors cross processes as IPC handles, CPU tensors
        # would need file-descriptor passing.
        padding = [torch.zeros(1, dtype=torch.uint8, device=device)] * ((num_sources or 0) - len(self.sources))
        return ([(PREFIX + "attach", encoded.to(device)), (PREFIX + "table", self.table.to(device))]
                + [(PREFIX + "source", t) for t in self.sources + padding])

    @staticmethod
    def from_wire(named: list[tuple[str, torch.Tensor]]) -> tuple[str, EngineCopy]:
        names = [n for n, _ in named]
        if names[:2] != [PREFIX + "attach", PREFIX + "table"]:
            raise ValueError(f"not a megarl attach payload: {names[:2]}")
        meta = json.loads(bytes(named[0][1].cpu().numpy()).decode())
        sources = [t for _, t in named[2:2 + meta["num_sources"]]]
        return meta["key"], EngineCopy(
            sources=sources, dst_names=meta["dst_names"], dtype=meta["dtype"],
            dst_shapes={n: tuple(s) for n, s in meta["dst_shapes"].items()},
            table=named[1][1].cpu(), zero_rows=meta["zero_rows"], rounds=meta["rounds"], dtypes=meta["dtypes"],
            fp8_block=meta["fp8_block"])


def apply_message(key: str, token: torch.Tensor, round: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Named tensors asking the engine to replay round ``round`` of attachment ``key`` (``token``: any small
    tensor)."""
    return [(PREFIX + f"apply.{round}." + key, token)]


def detach_message(key: str, token: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named tensors asking the engine to drop attachment ``key``: it closes its mappings of the trainer's
    tensors, whose memory the trainer can then free (while the engine generates)."""
    return [(PREFIX + "detach." + key, token)]


def checksum_message(key: str, result: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named tensors asking the engine to write the checksums (megarl.reshard.verify) of attachment ``key``'s
    parameters into ``result`` (int64 [num parameters, 2], a trainer tensor it maps), in ``dst_names`` order."""
    return [(PREFIX + "checksum." + key, result)]


def check_covered(params: Iterable[str], written: Collection[str]) -> None:
    """Every parameter of the engine's model is one the hand-over writes (``written``): one it never wrote would
    keep the weights the engine started with while the actor trains, every checksum of the written ones green."""
    never = sorted(set(params) - set(written))
    if never:
        raise ValueError(f"the engine's model holds {len(never)} parameters the hand-over never writes "
                         f"({never[:4]}{', ...' if len(never) > 4 else ''}): they would keep the engine's starting "
                         "weights while the actor trains, and rollouts would come from a model the trainer never "
                         "had. megarl's engine layout (megarl.reshard.engine_layout) does not know them: this model "
                         "family or engine version is not supported.")


class EngineApplier:
    """Engine side of an ``EngineCopy``: validated and compiled once, replayed by ``run``."""

    def __init__(self, copy: EngineCopy, params: dict[str, torch.Tensor]) -> None:
        check_covered(params, copy.dst_shapes)
        for name, shape in copy.dst_shapes.items():
            if name not in params:
                raise ValueError(f"the engine has no parameter `{name}`; the engine's model and the trainer's "
                                 "resharding plan disagree")
            p = params[name]
            held, want = str(p.dtype).removeprefix("torch."), copy.dtypes.get(name, copy.dtype)
            if held != want and name in copy.dtypes:
                raise ValueError(f"engine parameter `{name}` is {held}, but the hand-over writes {want} "
                                 "(rollout.weight_dtype = fp8): the engine must hold its linear layers in block FP8 "
                                 f"(float8_e4m3fn weights, float32 weight_scale_inv per {copy.fp8_block} x "
                                 f"{copy.fp8_block} block).")
            if held != want:
                raise ValueError(f"engine parameter `{name}` is {held}, but the trainer hands over {want}: the engine "
                                 f"would read the bits as other numbers. Start the engine in {want} (leave "
                                 "rollout.engine_args.dtype unset, or set it to model.dtype).")
            if tuple(p.shape) != tuple(shape) or not p.is_contiguous():
                scales = name.endswith("_scale_inv") and name in copy.dtypes  # another block shows as this
                raise ValueError(f"engine parameter `{name}` is {list(p.shape)} (contiguous: {p.is_contiguous()}); "
                                 f"the plan writes a contiguous {list(shape)}" + (
                                     f" (scales of {copy.fp8_block} x {copy.fp8_block} blocks: the engine's "
                                     "weight_block_size must be rollout.fp8_block)" if scales else ""))
        bounds = copy.rounds
        if bounds[0] != 0 or bounds[-1] != len(copy.table) or bounds != sorted(bounds):
            raise ValueError(f"round bounds {bounds} do not split a table of {len(copy.table)} segments")
        self.sources = copy.sources  # holds the IPC mappings open
        self.params = [params[n] for n in copy.dst_names]
        self.names = copy.dst_names
        self.zero = [(params[n], start) for n, start in copy.zero_rows.items()]
        dsts = [p.data for p in self.params]
        self.addresses = [p.data_ptr() for p in self.params]
        self.copies: list[SegmentCopy] = [make_segment_copy(copy.sources, dsts, copy.table[a:b],
                                                                    dst_names=copy.dst_names)
                                          for a, b in itertools.pairwise(bounds)]

    def check_same(self, model: torch.nn.Module) -> None:
        """Refuse, by name, an engine parameter the engine replaced since attaching (a new Parameter under its name,
        or new memory in the old one): the copy would fill the old memory while the engine reads the new."""
        now = dict(model.named_parameters())
        for name, param, address in zip(self.names, self.params, self.addresses, strict=True):
            if now.get(name) is not param or param.data_ptr() != address:
                raise RuntimeError(f"engine parameter `{name}` was replaced or given other memory after the "
                                   "hand-over attached (the engine re-created its tensor): the hand-over would write "
                                   "the old memory. The engine must keep its parameters, or re-attach.")

    @torch.no_grad()
    def run(self, round: int) -> None:
        """Write round ``round`` of the trainer's current weights into the parameters; returns once they are
        written."""
        if not 0 <= round < len(self.copies):
            raise ValueError(f"hand-over round {round} requested; this attachment has {len(self.copies)}")
        if round == 0:
            for param, start in self.zero:
                param.data[start:].zero_()
        copy = self.copies[round]
        copy.run()
        if copy.total_bytes and self.sources and self.sources[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the trainer may change its tensors once we return

    @torch.no_grad()
    def checksums(self, result: torch.Tensor) -> None:
        """Write the checksum of every parameter the copy writes into ``result`` (one row each)."""
        if result.shape != (len(self.params), 2):
            raise ValueError(f"checksum request for {result.shape[0]} parameters; this attachment writes "
                             f"{len(self.params)}")
        for i, param in enumerate(self.params):
            result[i] = tensor_checksum(param.data, self.names[i])
        if result.is_cuda:
            torch.cuda.current_stream().synchronize()  # the trainer reads them once we return


class HandoverState:
    """The attachments of one engine rank, keyed by the trainer's key."""

    def __init__(self) -> None:
        self.appliers: dict[str, EngineApplier] = {}

    def handle(self, model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
        """Serve one message for ``model``: an attachment (replacing any under the same key), an apply, a
        detach or a checksum request."""
        first = named[0][0] if named else ""
        if first == PREFIX + "attach":
            key, copy = EngineCopy.from_wire(named)
            self.appliers.pop(key, None)  # drop the old mappings before opening new ones
            self.appliers[key] = EngineApplier(copy, dict(model.named_parameters()))
        elif first.startswith(PREFIX + "apply."):
            round, _, key = first[len(PREFIX + "apply."):].partition(".")
            if key not in self.appliers:
                raise ValueError(f"no megarl attachment `{key}` in this engine (attached: {sorted(self.appliers)}); "
                                 "attach before applying")
            applier = self.appliers[key]
            if round == "0":
                applier.check_same(model)
            applier.run(int(round))
        elif first.startswith(PREFIX + "detach."):
            self.appliers.pop(first[len(PREFIX + "detach."):], None)
        elif first.startswith(PREFIX + "checksum."):
            key = first[len(PREFIX + "checksum."):]
            if key not in self.appliers:
                raise ValueError(f"no megarl attachment `{key}` in this engine (attached: {sorted(self.appliers)}); "
                                 "attach before verifying")
            self.appliers[key].checksums(named[0][1])
        else:
            raise ValueError(f"not a megarl hand-over message: {first!r}")

"""Offload idle training state to host memory, so that each phase of a step holds only what it uses.

During rollout the engine needs the GPU; the actor's optimizer state and gradient buffer, the critic and
the reference model are idle then, and during the actor's update the critic is idle, and the other way
round. ``ModelResidency`` moves whole storages of one model's parts to (pinned) host memory and back:
a storage is copied out, then resized to 0 bytes, which frees its memory; onloading resizes it and copies
the bytes back. Tensors that view a storage (Megatron's parameters and gradients are views into flat
buffers) stay valid, as they refer to the storage, not to an address. What keeps raw addresses must not
be offloaded: the actor's weights, which the resharder's copy tables and the engine's CUDA IPC mappings
point at, stay on the GPU.

Parts of a model: ``weights`` (its parameters, or DDP's parameter buffers), ``grads`` (DDP's gradient
buffers, freed without a copy: every train step zeroes them before use), ``optimizer`` (fp32 master
weights and Adam moments, the optimizer's own tensors).

Frozen weights (a storage that only parameters with ``requires_grad`` off view: a reference model's, a LoRA
actor's base) are copied out once: at a later offload a storage whose checksum (megarl.reshard.verify's, on the
device) equals the one its host copy was taken at is freed without copying, since the host already holds its
bytes. At Llama-3-8B's shape that is about 50 ms of checksums in place of 0.55 s of copying each time; a weight
changed in place since (a checkpoint loaded into it) is copied again.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

Part = Literal["weights", "grads", "optimizer"]
PARTS: tuple[Part, ...] = ("weights", "grads", "optimizer")


@dataclass
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None
    copied: Any = None
    """CUDA event recorded after the copy to ``host`` (None: nothing copied, or not on a GPU)."""


def bring_back(item: _Stored, stream: Any = None) -> int:
    """Reallocate an offloaded storage (on the current stream, whose pool it came from) and enqueue its copy
    back (on ``stream``, else the current one); the bytes copied."""
    item.storage.resize_(item.nbytes)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if item.host is None:
            _as_bytes(item.storage).zero_()
            return 0
        _as_bytes(item.storage).copy_(item.host, non_blocking=True)
    return item.nbytes


def _inner_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's wrappers (ChainedOptimizer -> MixedPrecision -> torch Adam)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, torch.optim.Optimizer):
            yield inner


def _ddp_buffers(model: Any) -> list[Any]:
    """Megatron DDP's parameter-and-gradient buffers, the expert-parallel ones included (an MoE model's experts
    under expert parallelism: most of its gradients); none for a model without DDP, such as the reference, whose
    modules' ``buffers`` is nn.Module's method."""
    return [b for m in model.models if isinstance(getattr(m, "buffers", None), list)
            for b in m.buffers + getattr(m, "expert_parallel_buffers", [])]


def _tensors(model: Any, part: Part) -> Iterator[torch.Tensor]:
    """The tensors of one part of a MegatronModel (anything with chunks, models, optimizer)."""
    if part == "weights":
        for buffer in _ddp_buffers(model):
            if buffer.param_data is not None:
                yield buffer.param_data
        for chunk in model.chunks:
            yield from chunk.parameters()
            yield from chunk.buffers()
    elif part == "grads":
        for buffer in _ddp_buffers(model):
            yield buffer.grad_data
    elif model.optimizer is not None:
        for opt in _inner_optimizers(model.optimizer):
            for group in opt.param_groups:
                yield from group["params"]
            for state in opt.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


class ModelResidency:
    """Where one model's parts live: ``offload(parts)`` / ``onload(parts)``; both are no-ops for parts
    already there. The optimizer's state only exists after its first step, so parts are collected at
    every offload; host buffers are kept and reused, since pinning memory is slow."""

    def __init__(self, model: Any, keep_frozen: bool | None = None) -> None:
        """``keep_frozen``: free unchanged frozen weights without copying them (None: on a GPU, where the copy
        costs about ten times the checksum; on the CPU a copy is cheaper than the checksum)."""
        self.model = model
        self.keep_frozen = torch.cuda.is_available() if keep_frozen is None else keep_frozen
        self._away: dict[Part, list[_Stored]] = {}
        self._host: dict[tuple[Part, int], torch.Tensor] = {}
        self._sums: dict[int, tuple[int, ...]] = {}
        """Weights storage index -> the checksum of the bytes its host buffer holds (frozen storages only)."""
        self._pin = torch.cuda.is_available()
        self.kept_bytes = 0
        """Bytes of frozen weights freed without a copy, their host copy still theirs (over all offloads)."""

    def _storages(self, part: Part) -> list[torch.UntypedStorage]:
        """The part's storages on the device, without those of the parts before it in PARTS: in float32
        the optimizer's master weights are the parameters themselves (or views of their buffer)."""
        earlier = {t.untyped_storage().data_ptr() for p in PARTS[: PARTS.index(part)] for t in _tensors(self.model, p)}
        found: dict[int, torch.UntypedStorage] = {}
        for tensor in _tensors(self.model, part):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in earlier:
                found.setdefault(key, storage)
        return list(found.values())

    def offload(self, parts: Iterable[Part]) -> int:
        """Copy the parts' storages to host memory and free them; returns the bytes freed."""
        freed = 0
        for part in parts:
            if part in self._away:
                continue
            stored = self.start_offload(part)
            if self._pin:
                torch.cuda.current_stream().synchronize()  # the copies finish before the memory is reused
            for item in stored:
                item.storage.resize_(0)
                freed += item.nbytes
        return freed

    def start_offload(self, part: Part, sums: dict[int, tuple[int, ...]] | None = None) -> list[_Stored]:
        """Enqueue the copies of the part's storages to host memory on the current stream, recording an
        event after each, and mark the part away; the caller frees each storage once its event completed.
        ``sums``: ``frozen_sums()`` taken before (else taken here)."""
        stored = []
        storages = self._storages(part)
        if part != "weights":
            sums = {}
        elif sums is None:
            sums = self.frozen_sums()
        for i, storage in enumerate(storages):
            if part == "grads":  # every train step zeroes them first: nothing to keep, only to free
                stored.append(_Stored(storage, storage.nbytes()))
                continue
            host = self._host.get((part, i))
            if i in sums and host is not None and host.numel() == storage.nbytes() and self._sums.get(i) == sums[i]:
                stored.append(_Stored(storage, storage.nbytes(), host))  # the host buffer holds these bytes
                self.kept_bytes += storage.nbytes()
                continue
            if host is None or host.numel() != storage.nbytes():
                host = host_buffer(storage.nbytes(), self._pin)
                self._host[part, i] = host
            host.copy_(_as_bytes(storage), non_blocking=True)
            if part == "weights":
                self._sums.pop(i, None)
                if i in sums:
                    self._sums[i] = sums[i]
            stored.append(_Stored(storage, storage.nbytes(), host))
            if self._pin:
                stored[-1].copied = torch.cuda.Event()
                stored[-1].copied.record()
        self._away[part] = stored
        return stored

    def frozen_sums(self) -> dict[int, tuple[int, ...]]:
        """The checksums of the weights storages (by index) that only frozen parameters view, taken on the current
        stream and read back at once (none without keep_frozen)."""
        if not self.keep_frozen:
            return {}
        storages = self._storages("weights")
        frozen = {p.untyped_storage().data_ptr() for chunk in self.model.chunks for p in chunk.parameters()
                  if not p.requires_grad}
        frozen -= {p.untyped_storage().data_ptr() for chunk in self.model.chunks for p in chunk.parameters()
                   if p.requires_grad}
        frozen -= {t.untyped_storage().data_ptr() for t in _tensors(self.model, "weights")
                   if not isinstance(t, torch.nn.Parameter)}  # DDP's buffers, module buffers: they may change
        index = [i for i, storage in enumerate(storages) if storage.data_ptr() in frozen]
        if not index:
            return {}
        from megarl.reshard.verify import tensor_checksum

        sums = torch.stack([tensor_checksum(_words(storages[i])) for i in index]).tolist()
        return {i: tuple(sum_) for i, sum_ in zip(index, sums, strict=True)}

    def away(self, part: Part) -> list[_Stored]:
        """Take the part's offloaded storages, for the caller to bring back (``bring_back``)."""
        return self._away.pop(part, [])

    def onload(self, parts: Iterable[Part]) -> int:
        """Bring the parts' storages back (same size, same tensors viewing them; gradients come back as zeros);
        returns the bytes copied from host memory."""
        moved = 0
        for part in parts:
            for item in self.away(part):
                moved += bring_back(item)
        if moved and self._pin:
            torch.cuda.current_stream().synchronize()  # the next offload may overwrite the host buffers
        return moved

    def device_bytes(self, part: Part) -> int:
        """Bytes the part holds on the device now (0 while offloaded)."""
        return sum(s.nbytes() for s in self._storages(part))


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked when ``pin``. Not through ``pin_memory=True``: torch's caching
    host allocator rounds every block up to a power of two, so 39 GiB of optimizer state would take 64."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed with CUDA error {int(err)}: "
                               "the host is out of lockable memory (see `ulimit -l` and the memory plan)")
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _words(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as 4-byte words where its size allows (the checksum's fastest element), else as bytes."""
    data = _as_bytes(storage)
    return data.view(torch.int32) if storage.nbytes() % 4 == 0 else data


class Residency:
    """Holds each model's parts on the device only in the phases that use them.

    ``offloadable`` maps a model name to the parts it may move; ``hold({name: parts})`` onloads those
    parts and offloads every other offloadable part. Seconds spent moving are summed in ``seconds``.

    On a GPU the two directions overlap: copies to the host run on one stream, copies back on another, and
    each storage that arrives takes the place of storages whose copy out has finished and which have been
    freed, so the device never holds more than ``slack_bytes`` beyond what it held before the move.
    """

    def __init__(self, models: dict[str, Any], offloadable: dict[str, set[Part]],
                 slack_bytes: int = 2**30) -> None:
        self.states = {name: ModelResidency(model) for name, model in models.items()}
        self.offloadable = {name: offloadable.get(name, set()) for name in models}
        self.slack_bytes = slack_bytes
        self.seconds = 0.0
        self._streams: tuple[Any, Any] | None = None

    def hold(self, needed: dict[str, set[Part]]) -> None:
        start = time.perf_counter()
        leaving = [(state, p) for name, state in self.states.items() for p in PARTS
                   if p in self.offloadable[name] and p not in needed.get(name, set()) and p not in state._away]
        coming = [(self.states[name], p) for name, parts in needed.items() for p in PARTS if p in parts]
        if torch.cuda.is_available():
            self._overlapped(leaving, coming)
        else:
            for state, part in leaving:  # free first, then load: the peak stays lower
                state.offload([part])
            for state, part in coming:
                state.onload([part])
        self.seconds += time.perf_counter() - start

    def _overlapped(self, leaving: list[tuple[ModelResidency, Part]], coming: list[tuple[ModelResidency, Part]]
                    ) -> None:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        out_stream, in_stream = self._streams
        main = torch.cuda.current_stream()
        # Frozen weights' checksums first: each reads its result back, which amid the copies out would wait for them
        sums = {id(state): state.frozen_sums() for state, part in leaving if part == "weights"}
        out_stream.wait_stream(main)  # the copies out read what the phase before wrote
        with torch.cuda.stream(out_stream):
            pending = [item for state, part in leaving for item in state.start_offload(part, sums.get(id(state)))]
        pending.reverse()  # oldest last: pop() frees in copy order
        freed = loaded = 0

        def free_one() -> None:
            nonlocal freed
            item = pending.pop()
            if item.copied is not None:
                item.copied.synchronize()
            item.storage.resize_(0)
            freed += item.nbytes

        in_stream.wait_stream(main)
        for state, part in coming:
            for item in state.away(part):
                while pending and loaded + item.nbytes > freed + self.slack_bytes:
                    free_one()
                loaded += item.nbytes
                bring_back(item, in_stream)  # allocated on the main stream: in_stream has waited for its work
        while pending:
            free_one()
        main.wait_stream(in_stream)
        in_stream.synchronize()  # the next move may overwrite the host buffers

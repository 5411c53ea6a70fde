"""Run megatron-core (0.16) on a CPU-only torch build with gloo.

megatron-core assumes CUDA in about sixty places: ``device="cuda"``,
``torch.cuda.current_device()``, ``.cuda()``, the CUDA RNG tracker, and asserts that
``tensor.type()`` is ``torch.cuda.FloatTensor``. CPU CI and laptops have no GPU, yet we
want the real Megatron model, schedules, DDP and optimizer there, so tests exercise the
same code that runs on clusters. This shim makes that possible without forking megatron:

1. A process-wide ``TorchFunctionMode`` rewrites every CUDA device argument to CPU, turns
   ``.cuda()`` into a no-op, and reports ``torch.cuda.*`` from ``Tensor.type()``.
2. The ``torch.cuda`` functions megatron calls unconditionally (``current_device``,
   ``synchronize``, streams, events, NVTX, RNG state) get CPU stand-ins.
3. Megatron's "CUDA" RNG tracker is mapped onto the CPU generator, so per-TP-rank seeds and
   ``tracker.fork()`` (dropout) behave as on GPU.
4. The torch ``LayerNorm``/``RMSNorm`` wrapper refuses sequence parallelism; it is correct
   under SP as long as its parameters carry ``sequence_parallel=True`` (so their grads are
   all-reduced over TP), which we set.
5. MoE's token dispatcher gets its split sizes as numpy arrays, as its device-to-host copy makes them.
6. ``torch.distributed.all_gather`` takes tensors of different lengths, as NCCL does and gloo does not: MoE under
   tensor parallelism gathers each TP rank's tokens for the local experts, whose counts differ by rank.

Measured with it: TP 2/4 (with and without SP), PP 2/4, interleaved PP and DP match the
single-rank loss and grad norm to ~1e-7 over several Adam steps. Pitfalls it does not fix
(handled by callers): interleaved PP over gloo needs ``batch_p2p_comm=False``, and fusion
flags must stay off on CPU (they invoke torch.compile).

``install()`` must run before ``megatron.core`` is imported; it is idempotent and refuses
to run when CUDA is available.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_installed = False


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # what torch.cuda.current_device() returns
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _run_backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None,
                  create_graph: bool = False, inputs: Any = None) -> None:
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if grad_tensors is None:
        grad_tensors = (None,) * len(tensors)
    elif isinstance(grad_tensors, torch.Tensor):
        grad_tensors = (grad_tensors,)
    grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors, strict=True))
    keep_graph = create_graph if retain_graph is None else retain_graph
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors, grads, keep_graph, create_graph, tuple(inputs or ()),
        allow_unreachable=True, accumulate_grad=True)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # torch >= 2.13 routes backward through __torch_function__, and a mode is popped
            # while its handler runs: custom autograd Functions of the TP layers would then run
            # their backward without the remap. Re-enter the mode and call the engine directly.
            if func is torch.Tensor.backward:
                kwargs.setdefault("grad_tensors", kwargs.pop("gradient", None))
            with self:
                return _run_backward(*args, **kwargs)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Inert:
    """Stands in for CUDA streams and events: every method is a no-op that returns another stand-in (MoE's token
    dispatcher synchronizes the event its stream's ``record_event()`` returns)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> _Inert:
        return self

    def __exit__(self, *args: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: _Inert()


def _patch_torch_cuda() -> None:
    cuda: Any = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _Inert
    cuda.Event = _Inert
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _Inert()
    cuda.default_stream = lambda *a, **k: _Inert()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None


def _patch_megatron() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.torch_norm as torch_norm

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # With one generator for "CPU" and "CUDA", fork() always sees the CPU state move and warns.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)

    original_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls, config, hidden_size, eps=1e-5, **kwargs):  # type: ignore[no-untyped-def]
        sp = config.sequence_parallel
        cfg = dataclasses.replace(config, sequence_parallel=False) if sp else config
        norm = original_new(cls, cfg, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_new  # type: ignore[method-assign]

    # MoE's token dispatcher copies its split sizes "to the host" as numpy arrays, which all_to_all takes; a tensor
    # already on the CPU would stay a tensor, which it does not take.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _patch_uneven_all_gather() -> None:
    import torch.distributed as dist

    even = dist.all_gather

    def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        if all(t.shape == tensor.shape for t in tensor_list):
            return even(tensor_list, tensor, group=group, async_op=async_op)
        assert not async_op, "uneven all_gather on gloo runs synchronously"
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in tensor_list]
        even(parts, padded, group=group)
        for out, part in zip(tensor_list, parts, strict=True):
            out.copy_(part[: out.shape[0]])
        return None

    dist.all_gather = all_gather


def install() -> None:
    """Activate the shim for the life of the process. Must precede ``import megatron.core``."""
    global _installed
    if _installed:
        return
    assert not torch.cuda.is_available(), "the CPU shim must not be installed on a CUDA machine"
    _CudaToCpuMode().__enter__()
    _patch_torch_cuda()
    _patch_megatron()
    _patch_uneven_all_gather()
    _installed = True


def installed() -> bool:
    return _installed

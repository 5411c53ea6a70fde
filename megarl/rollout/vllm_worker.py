"""megarl's weight loader inside vLLM's workers (imported there by name; only the engines-apart methods import
megarl, megarl.reshard.receiver, when called).

``VLLMEngine`` passes ``worker_extension_cls="megarl.rollout.vllm_worker.MegarlWorkerExtension"``:
vLLM mixes this class into every worker, and ``LLM.collective_rpc("megarl_load_weights", ...)``
runs the method in each of them. Methods are called by name, so nothing is pickled and vLLM's
``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off.

Payload: one safetensors file per engine rank (in /dev/shm), holding that rank's tensors in the
engine layout with engine names (megarl.reshard.engine_layout). The worker reads one tensor at a
time, so its extra memory is one tensor (in-place path) or one layer (load path), not the model.

Two ways in, chosen by parameter shapes (``load_engine_tensors``):
- in place: every parameter has its engine-layout shape (GPU engines): ``param.copy_`` per tensor,
  no conversion, no reallocation (CUDA graphs keep pointing at the same memory);
- load path: vLLM's CPU backend repacks linear weights after loading (oneDNN handles; the
  parameters become empty, shape [0]), so a copy would not reach the kernels. Each engine tensor's
  pieces go back to their places in full-size HF tensors (qkv_proj -> q/k/v, gate_up_proj -> gate/up,
  vocab padding dropped; with tensor parallelism the other ranks' slices stay zero, since vLLM's loaders
  read only their own) and through vLLM's in-place reload (``Worker.reload_weights``), which runs the
  model's ``load_weights`` layer by layer and repacks each layer (fused MoE experts: megarl repacks them, since
  vLLM does so only at the first load). Engine tensors are named as SGLang names them; vLLM's fused experts sit
  one module deeper (``experts.routed_experts.w13_weight``).
"""

from __future__ import annotations

import ctypes
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Layout = dict[str, Any]
"""{"hf_shapes": {hf name: shape}, "pieces": {engine name: [[hf name, dim, start, stop, offset], ...]}}"""


def _to_hf(names: list[str], get: Callable[[str], torch.Tensor], layout: Layout
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full-size HF tensors holding this engine rank's pieces, in the order of ``names``.

    With tensor parallelism the rest of each HF tensor stays zero: vLLM's loaders read only this rank's
    slice of it, which is exactly where the pieces go. Forward order or sorted names (as safetensors lists
    them) keep each layer's tensors together, so vLLM's layer-wise reload holds one layer at a time."""
    for name in names:
        tensor = get(name)
        # Addressed as a matrix (megarl.reshard.engine_layout.matrix_shape): MoE experts [E, a, b] as [E * a, b].
        matrix = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 2 else tensor
        built: dict[str, torch.Tensor] = {}
        for hf, dim, start, stop, offset in layout["pieces"][name]:
            if hf not in built:
                built[hf] = torch.zeros(layout["hf_shapes"][hf], dtype=tensor.dtype, device=tensor.device)
            target = built[hf].narrow(dim, start, stop - start)
            if dim == 0:
                target.copy_(matrix.narrow(0, offset, stop - start))
            else:  # columns of a block of rows: offset = first row * columns + first column
                row, column = divmod(offset, matrix.shape[1])
                target.copy_(matrix[row:row + target.shape[0], column:column + stop - start])
        yield from built.items()


@torch.no_grad()
def load_engine_tensors(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]],
                        get: Callable[[str], torch.Tensor], layout: Layout, reload: Reload) -> str:
    """Write engine-layout tensors (``get(name)``, of ``shapes``) into ``model``; returns the path taken.
    ``layout``: this engine rank's HF pieces per engine tensor (megarl.rollout.vllm.engine_rank_layout)."""
    from megarl.reshard.handover import check_covered

    params = dict(model.named_parameters())
    own = {name: _own_name(name, params) for name in shapes}
    unknown = sorted(n for n in own.values() if n not in params)
    if unknown:
        raise ValueError(f"the engine has no parameters {unknown[:3]} ({len(unknown)} unknown); the model and "
                         "the engine layout disagree")
    check_covered(params, set(own.values()))
    if all(tuple(params[own[n]].shape) == tuple(s) for n, s in shapes.items()):
        for name in shapes:
            params[own[name]].copy_(get(name))
        return "in_place"
    reload(_to_hf(list(shapes), get, layout))
    # A fused MoE layer repacks its experts for its kernel only at the first load (vLLM skips it on weight
    # updates): after a reload they would stay in the checkpoint's layout, which the CPU kernel misreads.
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if hasattr(module, "w13_weight") and kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
    # A tied lm_head shares embed_tokens' parameter but is never loaded itself, so vLLM's reload does not
    # rerun its post-load processing: on CPU that would leave its packed copy of the old embedding.
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if (head is not None and embed is not None and head is not embed and hasattr(head, "weight")
            and head.weight.data_ptr() == embed.weight.data_ptr() and hasattr(head, "quant_method")):
        head.quant_method.process_weights_after_loading(head)
    return "load"


def _own_name(name: str, params: dict[str, torch.nn.Parameter]) -> str:
    """vLLM's name for an engine-layout tensor: its fused MoE experts sit one module deeper than SGLang's
    (``mlp.experts.routed_experts.w13_weight``)."""
    if name in params:
        return name
    return name.replace(".mlp.experts.", ".mlp.experts.routed_experts.")


def rss_bytes() -> int:
    """This process's resident memory, after returning freed heap pages to the OS (glibc ``malloc_trim``)
    so that it counts live memory rather than allocator caching."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MegarlWorkerExtension:
    """Methods vLLM adds to each of its workers: ``self`` is the vLLM ``Worker``. vLLM refuses names that
    the worker already has, hence the prefix, and no annotations or stubs of the worker's own attributes."""

    def megarl_load_weights(self, paths: list[str], layouts: list[Layout]) -> str:
        """Load ``paths[tp_rank]`` (a safetensors file of engine-layout tensors) into this worker's model."""
        from vllm.distributed import get_tensor_model_parallel_rank

        worker: Any = self
        model = worker.model_runner.get_model()
        device = next(model.parameters()).device
        rank = get_tensor_model_parallel_rank()
        with safe_open(paths[rank], framework="pt", device=str(device)) as f:
            # safetensors lists names sorted, which keeps each layer's tensors together: vLLM's layer-wise
            # reload then buffers one layer at a time.
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

            def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

            return load_engine_tensors(model, shapes, f.get_tensor, layouts[rank], reload)

    def megarl_join_handover(self, plan: bytes, first_gpu: int, host: str, port: int, backend: str,
                             timeout_s: float, dtype: str) -> str:
        """Engines on GPUs of their own: join the hand-over group as plan GPU ``first_gpu`` + this worker's TP rank
        (megarl.reshard.receiver); returns where hand-overs land ("in_place": the parameters, or "load")."""
        from vllm.distributed import get_tensor_model_parallel_rank

        from megarl.reshard.handover import check_covered
        from megarl.reshard.handover_group import handover_group
        from megarl.reshard.receiver import EngineReceiver

        worker: Any = self
        model = worker.model_runner.get_model()
        params = dict(model.named_parameters())
        device, gpu = next(model.parameters()).device, first_gpu + get_tensor_model_parallel_rank()
        plan_object = pickle.loads(plan)
        own = {name: _own_name(name, params) for name in plan_object.engine_shapes(gpu)}
        check_covered(params, set(own.values()))
        by_engine_name = {name: params[mine] for name, mine in own.items() if mine in params}
        group = handover_group(gpu, plan_object.num_gpus, host, port, backend=backend, timeout_s=timeout_s,
                               device=device if device.type == "cuda" else None)
        worker.megarl_receiver = EngineReceiver(plan_object, gpu, group, params=by_engine_name,
                                                dtype=getattr(torch, dtype), device=device)
        return "in_place" if worker.megarl_receiver.in_place else "load"

    def megarl_receive_weights(self, layouts: list[Layout]) -> str:
        """Receive one hand-over through the group joined in ``megarl_join_handover`` and load it; returns the path
        taken (``load_engine_tensors``)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        worker: Any = self
        tensors = worker.megarl_receiver.receive()
        if worker.megarl_receiver.in_place:
            return "in_place"
        model = worker.model_runner.get_model()

        def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

        # sorted names keep each layer's tensors together, as the file path's safetensors order does
        shapes = {name: tuple(tensors[name].shape) for name in sorted(tensors)}
        return load_engine_tensors(model, shapes, tensors.__getitem__, layouts[get_tensor_model_parallel_rank()],
                                   reload)

    def megarl_rss(self) -> int:
        """Resident memory of this worker process (tests and diagnostics)."""
        return rss_bytes()

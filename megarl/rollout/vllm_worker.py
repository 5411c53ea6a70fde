"""megarl's weight loader inside vLLM's workers (imported there by name, so it imports no megarl module).

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
  parameters become empty, shape [0]), so a copy would not reach the kernels. The tensors are
  renamed and split back into HF tensors (qkv_proj -> q/k/v, gate_up_proj -> gate/up, vocab padding
  dropped) and go through vLLM's in-place reload (``Worker.reload_weights``), which runs the
  model's ``load_weights`` layer by layer and repacks each layer. Needs full tensors (tensor_parallel 1).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from safetensors import safe_open

Reload = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


def _to_hf(names: list[str], get: Callable[[str], torch.Tensor], dims: dict[str, int]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors from engine-layout tensors of a tensor-parallel-1 engine, in the given order.
    Forward order or sorted names (as safetensors lists them) keep each layer's tensors together, so vLLM's
    layer-wise reload holds one layer at a time."""
    q, kv = dims["num_heads"] * dims["head_dim"], dims["num_kv_heads"] * dims["head_dim"]
    for name in names:
        tensor = get(name)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            yield name, tensor[:dims["vocab_size"]]  # the engine layout pads the vocab to a multiple of 64
        elif ".qkv_proj." in name:
            for part, piece in zip("qkv", tensor.split([q, kv, kv]), strict=True):
                yield name.replace("qkv_proj", f"{part}_proj"), piece
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            yield name.replace("gate_up_proj", "gate_proj"), gate
            yield name.replace("gate_up_proj", "up_proj"), up
        else:
            yield name, tensor


@torch.no_grad()
def load_engine_tensors(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]],
                        get: Callable[[str], torch.Tensor], dims: dict[str, int], tp_size: int,
                        reload: Reload) -> str:
    """Write engine-layout tensors (``get(name)``, of ``shapes``) into ``model``; returns the path taken."""
    params = dict(model.named_parameters())
    unknown = sorted(set(shapes) - set(params))
    if unknown:
        raise ValueError(f"the engine has no parameters {unknown[:3]} ({len(unknown)} unknown); the model and "
                         "the engine layout disagree")
    if all(tuple(params[n].shape) == tuple(s) for n, s in shapes.items()):
        for name in shapes:
            params[name].copy_(get(name))
        return "in_place"
    if tp_size != 1:
        raise ValueError("this engine repacks its weights after loading (vLLM's CPU backend), so updates need "
                         f"full tensors; that needs tensor_parallel 1, not {tp_size}")
    reload(_to_hf(list(shapes), get, dims))
    # A tied lm_head shares embed_tokens' parameter but is never loaded itself, so vLLM's reload does not
    # rerun its post-load processing: on CPU that would leave its packed copy of the old embedding.
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if (head is not None and embed is not None and head is not embed and hasattr(head, "weight")
            and head.weight.data_ptr() == embed.weight.data_ptr() and hasattr(head, "quant_method")):
        head.quant_method.process_weights_after_loading(head)
    return "load"


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

    def megarl_load_weights(self, paths: list[str], dims: dict[str, int], tp_size: int) -> str:
        """Load ``paths[tp_rank]`` (a safetensors file of engine-layout tensors) into this worker's model."""
        from vllm.distributed import get_tensor_model_parallel_rank

        worker: Any = self
        model = worker.model_runner.get_model()
        device = next(model.parameters()).device
        with safe_open(paths[get_tensor_model_parallel_rank()], framework="pt", device=str(device)) as f:
            # safetensors lists names sorted, which keeps each layer's tensors together: vLLM's layer-wise
            # reload then buffers one layer at a time.
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}

            def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

            return load_engine_tensors(model, shapes, f.get_tensor, dims, tp_size, reload)

    def megarl_rss(self) -> int:
        """Resident memory of this worker process (tests and diagnostics)."""
        return rss_bytes()

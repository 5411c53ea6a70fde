"""megarl's code inside SGLang's model workers.

- ``LOADER``: ``SGLangEngine`` registers it with SGLang's ``custom_weight_loader`` and names it as the
  ``load_format`` of ``update_weights_from_tensor``; SGLang then calls it in every TP worker with the model and
  that worker's named tensors (megarl.reshard.handover's wire format).
- ``AliasingLoader`` (rollout.alias_weights): SGLang's model loader, passed as ``load_format``. It builds the
  model in host memory, points the parameters that alias the actor's tensors at the trainer's memory (CUDA IPC
  views, from the file ``SGLangEngine`` names in ``model_loader_extra_config``) and moves everything else to the
  GPU: the engine never allocates the aliased parameters. It runs before SGLang captures its CUDA graphs, which
  therefore read the actor's addresses. With the model built, it resets the engine's load config to SGLang's
  default: SGLang reads LoRA adapters (actor.lora.handover: adapter) with that config.

Importing this module must stay cheap and free of SGLang: it runs in SGLang's scheduler processes.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Any

import torch

from megarl.reshard.handover import PREFIX, HandoverState
from megarl.rollout.sglang_fp8 import check_block_fp8

LOADER = "megarl.rollout.sglang_loader.load"
ALIASES_KEY = "megarl_aliases"
"""``model_loader_extra_config`` key of the alias file: per engine rank, (name, packaged tensor) pairs."""

_STATE = HandoverState()
_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
"""Models whose block-FP8 layers ``check_block_fp8`` passed: their format and runner do not change afterwards."""


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    if named_tensors and named_tensors[0][0] == PREFIX + "attach" and model not in _CHECKED:
        check_block_fp8(model)  # rollout.weight_dtype = fp8: the engine's GEMM reads what the copy writes, as written
        _CHECKED.add(model)
    _STATE.handle(model, named_tensors)


@torch.no_grad()
def alias_parameters(model: torch.nn.Module, views: dict[str, torch.Tensor], device: torch.device) -> int:
    """Point the parameters named in ``views`` at those tensors and move every other parameter and buffer to
    ``device`` (a copy of its own); returns the bytes now aliased. A view whose name, shape or dtype the model does
    not have is an error."""
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(views) - set(params))
    if unknown:
        raise ValueError(f"the engine's model has no parameters {unknown[:5]}: the trainer's plan and the engine's "
                         "model disagree")
    aliased = 0
    for name, view in views.items():
        param = params[name]
        if view.shape != param.shape or view.dtype != param.dtype:
            raise ValueError(f"engine parameter `{name}` is {list(param.shape)} {param.dtype}; the actor's "
                             f"tensor mapped onto it is {list(view.shape)} {view.dtype}")
        param.data = view  # a tied parameter is one object under both names: aliased under both
        aliased += view.numel() * view.element_size()
    mapped = {v.data_ptr() for v in views.values()}
    moved: dict[int, torch.Tensor] = {}  # tied tensors share one storage: moved once

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in moved:
            moved[t.data_ptr()] = t.to(device, copy=True)
        return moved[t.data_ptr()]

    for param in {id(p): p for p in params.values()}.values():  # a tied parameter once
        if param.data_ptr() not in mapped:
            param.data = own(param.data)
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = own(buf)
    return aliased


def check_aliases(model: torch.nn.Module, views: dict[str, torch.Tensor]) -> None:
    """After the engine's own post-processing: every aliased parameter still reads the actor's memory."""
    params = dict(model.named_parameters(remove_duplicate=False))
    moved = [n for n, v in views.items() if n not in params or params[n].data_ptr() != v.data_ptr()]
    if moved:
        raise RuntimeError(f"the engine replaced parameters {moved[:5]} after megarl mapped them onto the actor's "
                           "memory (its loading post-processing repacked them); set rollout.alias_weights: false")


class AliasingLoader:
    """SGLang model loader (``load_format``) for rollout.alias_weights; SGLang calls ``load_model``."""

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config

    def download_model(self, model_config: Any) -> None:
        pass  # it reads no files: the hand-over writes every parameter that is not aliased

    def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
        from sglang.srt.configs.load_config import LoadFormat
        from sglang.srt.distributed import get_tensor_model_parallel_rank
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model, _post_load_weights
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()  # devices travel as UUIDs
        rank = get_tensor_model_parallel_rank()
        with open(self.load_config.model_loader_extra_config[ALIASES_KEY], "rb") as f:
            wires = pickle.load(f)[rank]
        views = {name: MultiprocessingSerializer.deserialize(blob) for name, blob in wires}
        quant_config = _get_quantization_config(model_config, self.load_config)
        # Built in host memory (uninitialised, so untouched pages cost nothing): the GPU never holds the aliased
        # parameters' own storage, and the engine sizes its KV cache on what is really free.
        with set_default_torch_dtype(model_config.dtype):
            with torch.device("cpu"):
                model = _initialize_model(model_config, self.load_config, quant_config)
            device = torch.device("cuda", torch.cuda.current_device())
            aliased = alias_parameters(model, views, device)
            with device:
                _post_load_weights(model)
                for module in model.modules():
                    quant_method = getattr(module, "quant_method", None)
                    if quant_method is not None:
                        quant_method.process_weights_after_loading(module)
        check_aliases(model, views)
        # SGLang 0.5.17 reads LoRA adapters with a DefaultModelLoader built on this same load config
        # (srt/lora/lora.py LoRAAdapter.initialize_weights), which refuses extra config keys not its own and load
        # formats other than its file formats (this class is none): the model is built, neither is needed any more.
        del self.load_config.model_loader_extra_config[ALIASES_KEY]
        self.load_config.load_format = LoadFormat.AUTO
        model._megarl_aliases = views  # holds the IPC mappings open
        print(f"megarl: engine rank {rank} maps {aliased / 2**30:.2f} GiB of the actor's weights ({len(views)} "
              "tensors)", flush=True)
        return model.eval()

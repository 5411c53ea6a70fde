"""megarl's weight loader inside SGLang's model workers.

``SGLangEngine`` registers ``LOADER`` with SGLang's ``custom_weight_loader`` and names it as the
``load_format`` of ``update_weights_from_tensor``; SGLang then calls it in every TP worker with the
model and that worker's named tensors (megarl.reshard.handover's wire format). Importing it must
stay cheap and free of SGLang: it runs in SGLang's scheduler processes.
"""

from __future__ import annotations

import torch

from megarl.reshard.handover import HandoverState

LOADER = "megarl.rollout.sglang_loader.load"

_STATE = HandoverState()


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    _STATE.handle(model, named_tensors)

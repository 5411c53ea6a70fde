"""actor.lora.handover: adapter on SGLang: the engine serves the actor's adapters through its own LoRA support.

SGLang 0.5.17 (srt/server_args.py ``check_lora_server_args``, srt/lora/) needs, when no adapter is loaded at start,
both ``max_lora_rank`` and ``lora_target_modules``: its LoRA memory pool is sized from them once, and an adapter
of a larger rank or another module is refused at load (``can_support``). It has no rank ceiling of its own (the
pool holds any ``max_lora_rank``); its decode CUDA graphs and radix cache work with LoRA (graphs are captured
with the adapter slots' buffers, the radix cache keys prefixes by adapter); speculative decoding other than NGRAM
is refused, and it scales every adapter by alpha / r (it ignores peft's ``use_rslora``, so megarl refuses rslora
there). One adapter at a time: ``max_loras_per_batch`` 1, every request names the current adapter, and each
hand-over loads the new one under a new name before unloading the old (SGLang refuses a name already loaded).
The LoRA buffers are allocated outside the memory saver's weights region, so ``sleep`` keeps them.

Adapters are read from the PEFT directory the driver writes (megarl.lora.handover), as vLLM reads them:
SGLang's ``load_lora_adapter_from_tensors`` would skip a file of a few MB but copies the tensors to host memory
in the engine all the same (srt/lora/lora.py ``_process_weight``), and would need the peft names and config
built twice; the file keeps one format for both engines.

Importing this module must stay free of SGLang (CPU tests build the arguments without it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megarl.config.lora import HF_TARGETS, TARGETS
from megarl.errors import UserError

SPECULATIVE_WITH_LORA = (None, "NGRAM")
"""speculative_algorithm values SGLang 0.5.17 serves LoRA with."""


def lora_target_modules(targets: Sequence[str]) -> list[str]:
    """SGLang's ``lora_target_modules`` for actor.lora.target_modules (megarl's names), in a fixed order: the HF
    modules, which SGLang stacks into qkv_proj and gate_up_proj itself, as megarl.lora.export names them."""
    unknown = [t for t in targets if t not in HF_TARGETS]
    if unknown or not targets:
        raise UserError(f"actor.lora.target_modules = {list(targets)}: SGLang serves adapters on {list(TARGETS)} "
                        "only, and at least one. Fix: list only those.")
    return [hf for t in TARGETS if t in targets for hf in HF_TARGETS[t]]


def lora_engine_args(rank: int, targets: Sequence[str], engine_args: dict[str, Any], is_moe: bool = False
                     ) -> dict[str, Any]:
    """The ``sglang.Engine`` arguments that serve one adapter of ``rank`` on ``targets``; a combination SGLang or
    megarl does not serve is a UserError naming it."""
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"actor.lora.rank = {rank!r}: adapters handed over to SGLang need a rank >= 1. Fix: set "
                        "actor.lora.rank, or actor.lora.handover: merged.")
    if is_moe:
        # megarl adapts no expert layer, and SGLang's MoE LoRA path (srt/lora/lora_moe_runners.py) is untested here.
        raise UserError("actor.lora.handover = adapter with rollout.engine = sglang on a mixture-of-experts model: "
                        "megarl does not hand adapters of an MoE model to SGLang (its MoE LoRA path is not "
                        "verified with megarl's adapters). Fix: set actor.lora.handover: merged.")
    speculative = engine_args.get("speculative_algorithm")
    if speculative not in SPECULATIVE_WITH_LORA:
        raise UserError(f"rollout.engine_args.speculative_algorithm = {speculative!r} with actor.lora.handover = "
                        "adapter: SGLang 0.5.17 serves LoRA only with NGRAM speculative decoding or none. Fix: "
                        "remove speculative_algorithm, or set actor.lora.handover: merged.")
    for key in ("enable_lora", "max_lora_rank", "lora_target_modules", "lora_paths", "max_loras_per_batch"):
        if key in engine_args:
            raise UserError(f"rollout.engine_args.{key} = {engine_args[key]!r}: with actor.lora.handover = adapter "
                            "megarl sets SGLang's LoRA arguments from actor.lora itself. Fix: remove it from "
                            "rollout.engine_args.")
    return {"enable_lora": True, "max_lora_rank": rank, "lora_target_modules": lora_target_modules(targets),
            "max_loras_per_batch": 1}


class AdapterSlot:
    """The one adapter an SGLang engine serves: ``load`` puts a new one in place of the last; ``request`` is what
    every generate request passes (SGLang's ``lora_path`` takes a loaded adapter's name)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.name: str | None = None
        self._count = 0

    def request(self) -> dict[str, str]:
        return {} if self.name is None else {"lora_path": self.name}

    def load(self, path: str | Path) -> None:
        """Load the PEFT adapter directory ``path`` under a new name, then unload the previous adapter: requests
        started before hold the old one in SGLang's registry until they finish, new ones use the new name."""
        self._count += 1
        name = f"megarl-{self._count}"
        answer = self.engine.load_lora_adapter(lora_name=name, lora_path=str(path))
        if not getattr(answer, "success", False):
            raise RuntimeError(f"SGLang did not load the adapter at {path}: {getattr(answer, 'error_message', answer)}")
        previous, self.name = self.name, name
        if previous is not None:
            answer = self.engine.unload_lora_adapter(lora_name=previous)
            if not getattr(answer, "success", False):
                raise RuntimeError(f"SGLang did not unload adapter {previous}: "
                                   f"{getattr(answer, 'error_message', answer)}")

"""SGLang rollout engine: one ``sglang.Engine`` per rollout group, colocated with the trainer.

Weights arrive already in SGLang's per-rank layout (megarl.reshard writes them), so the update
is ``update_weights_from_tensor(load_format="direct")`` with one ``LocalSerializedTensor`` per
parameter: every engine rank opens the CUDA IPC handle of the tensor that lives on its own GPU
and copies it into its parameter, with no slicing and no conversion. SGLang >= 0.5.22 requires
``begin_weight_update`` / ``end_weight_update`` around updates; 0.5.17 lacks them, so both are
called only when present. Colocation: ``sleep`` releases weights and KV cache (torch memory
saver, ``enable_memory_saver``) while the trainer trains; ``wake`` resumes them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from megarl.errors import UserError
from megarl.models.spec import load_spec
from megarl.reshard.engine_layout import check_rollout_tp
from megarl.rollout.base import Completion, SamplingParams, check_prompts

log = logging.getLogger(__name__)


class SGLangEngine:
    """A real SGLang engine over ``tensor_parallel`` GPUs (this process drives it)."""

    def __init__(self, hf_dir: str, *, tensor_parallel: int = 1, gpu_memory_fraction: float = 0.7,
                 max_model_len: int | None = None, seed: int = 0, enable_sleep: bool = True,
                 load_format: str = "auto", **engine_args: Any) -> None:
        spec = load_spec(hf_dir)  # unsupported architectures fail here, before any GPU work
        check_rollout_tp(spec, tensor_parallel)
        try:
            import sglang
        except ImportError as err:
            raise UserError(f"rollout.engine = sglang but SGLang cannot be imported ({err}). Install the GPU "
                            "image (Dockerfile) or use rollout.engine = vllm.") from None
        self.tensor_parallel = tensor_parallel
        self.max_model_len = max_model_len or spec.max_position_embeddings
        self.vocab_size = spec.vocab_size
        args = dict(model_path=hf_dir, tp_size=tensor_parallel, skip_tokenizer_init=True,
                    mem_fraction_static=gpu_memory_fraction, random_seed=seed,
                    enable_memory_saver=enable_sleep, context_length=self.max_model_len,
                    load_format=load_format) | engine_args
        try:
            self.engine = sglang.Engine(**args)
        except Exception as err:  # the engine's own exception carries its log tail
            raise UserError(f"SGLang failed to start for {hf_dir} (tp={tensor_parallel}): "
                            f"{str(err)[-2000:]}") from None
        self._versioned_updates = hasattr(self.engine, "begin_weight_update")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        check_prompts(prompts, params, self.max_model_len, self.vocab_size)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                    "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
                    "n": 1}
        expanded = [list(p) for p in prompts for _ in range(params.n)]
        per_request = [sampling | ({"sampling_seed": params.seed + i} if params.seed is not None else {})
                       for i in range(len(expanded))]
        outputs = self.engine.generate(input_ids=expanded, sampling_params=per_request, return_logprob=True)
        completions = []
        for i, out in enumerate(outputs):
            meta = out["meta_info"]
            finish = meta.get("finish_reason") or {}
            completions.append(Completion(
                prompt_index=i // params.n,
                token_ids=list(out["output_ids"]),
                logprobs=[float(entry[0]) for entry in meta["output_token_logprobs"]],
                finish_reason="length" if finish.get("type") == "length" else "stop"))
        return completions

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Engine-layout tensors of this GPU's engine rank (tensor_parallel == 1 in one process)."""
        assert self.tensor_parallel == 1, "use update_weights_from_ranks for engines over several GPUs"
        self.update_weights_from_ranks([serialize_for_engine(named_tensors)])

    def update_weights_from_ranks(self, per_rank: list[dict[str, bytes]]) -> None:
        """Deliver handles gathered from every engine rank (``serialize_for_engine`` on each GPU's process)."""
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

        assert len(per_rank) == self.tensor_parallel
        payload = [(name, LocalSerializedTensor(values=[rank[name] for rank in per_rank])) for name in per_rank[0]]
        if self._versioned_updates:
            self.engine.begin_weight_update(selector="all")
        ok, message = self.engine.update_weights_from_tensor(payload, load_format="direct", flush_cache=True)
        if self._versioned_updates:
            self.engine.end_weight_update()
        if not ok:
            raise RuntimeError(f"SGLang rejected the weight update: {message}")

    def sleep(self) -> None:
        self.engine.release_memory_occupation()

    def wake(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        self.engine.shutdown()


def serialize_for_engine(named_tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """CUDA IPC handles of this GPU's engine-layout tensors (no data is copied)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return {name: MultiprocessingSerializer.serialize(t.detach()) for name, t in named_tensors.items()}

"""SGLang started in block FP8 for rollout.weight_dtype = fp8: the engine's side of the FP8 hand-over.

The trainer quantizes (megarl.reshard.fp8, executor) and the engine's copy moves float8_e4m3fn weights and float32
``weight_scale_inv`` (one scale per b x b block, b = rollout.fp8_block: 128, or 64 for small models) as bytes into
its parameters (megarl.reshard.handover). For that the engine must hold its linear layers in exactly that format, and
its GEMM must read them as written:

- SGLang 0.5.17's ``Fp8Config`` builds block-FP8 layers (``Fp8LinearMethod.create_fp8_weight_``: ``weight``
  float8_e4m3fn [out, in], ``weight_scale_inv`` float32 [ceil(out / b), ceil(in / b)], merged layers' parts at
  their block offsets) only for a serialized FP8 checkpoint, i.e. from config.json's ``quantization_config``
  (``weight_block_size`` without it is refused), whose ``weight_block_size: [b, b]`` sets the block.
  ``Fp8ModelDir`` is the model's directory as symlinks with that config.json; the weights come from the hand-over,
  so the engine loads ``dummy`` ones (SGLang's loader would cast the bf16 checkpoint into the FP8 parameters and
  leave the scales unset). megarl's first hand-over runs before the engine generates anything
  (megarl.loop.weight_sync.connect, in the trainer's constructor), and it writes every engine tensor, quantized or
  not.
- After loading, ``process_weights_after_loading_block_quant`` requantizes the scales to UE8M0 in place when
  DeepGEMM is the block-FP8 runner (``requant_block_scale_ue8m0_for_deepgemm``: on Blackwell,
  ``DEEPGEMM_SCALE_UE8M0``), and DeepGEMM on Hopper reads TMA-aligned column-major scales it makes per call;
  its ``auto`` choice is DeepGEMM wherever the ``deep_gemm`` package imports. ``fp8_gemm_runner_backend: triton``
  pins ``triton_w8a8_block_fp8_linear``: ``w8a8_block_fp8_matmul_triton`` reads ``weight`` [N, K] and
  ``weight_scale_inv`` [ceil(N / b), ceil(K / b)] row-major float32 as they are (any b: the layer's
  ``weight_block_size`` sets its default tiles and the activations' quantization groups), and the post-processing then
  leaves both untouched (no requantization, no copy), so a copy into them after every update is what the next GEMM
  reads, at the addresses the CUDA graphs captured. ``check_block_fp8`` (in the engine, when the hand-over attaches)
  refuses an engine whose layers say otherwise; a block other than the trainer's shows there as scales of another
  shape (megarl.reshard.handover).

Importing this module must stay free of SGLang: ``check_block_fp8`` runs in SGLang's scheduler processes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.errors import UserError

RUNNER_ARG = "fp8_gemm_runner_backend"
RUNNER = "triton"
"""The block-FP8 GEMM runner that reads ``weight`` and ``weight_scale_inv`` as the hand-over writes them."""
RUNNER_FUNCTION = "triton_w8a8_block_fp8_linear"
"""What SGLang's Fp8LinearMethod calls with that runner (``w8a8_block_fp8_linear``)."""
ATTENTION_ARGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
SCALE_FREE_ATTENTION = ("triton", "fa3")
"""Attention backends that leave the attention layers' k_scale / v_scale alone with a bf16 KV cache. With a
quantization_config every attention layer has them, the dummy load fills them with noise (+-1e-3) that no hand-over
writes, and SGLang keeps a positive draw as the layer's scale: FlashInfer multiplies the softmax scale and the output
by it, baked into its captured decode graphs (SGLang 0.5.17's flashinfer_backend)."""


def quantization_config(block: int) -> dict[str, Any]:
    """config.json's ``quantization_config`` of a block-FP8 checkpoint in blocks of ``block`` x ``block`` as SGLang
    reads it (``Fp8Config.from_config``; ``fmt`` is metadata it ignores, written as DeepSeek-V3's checkpoints do)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [block, block]}


@dataclass
class Fp8ModelDir:
    """A temporary directory of symlinks to an HF model's files whose config.json carries ``quantization_config``:
    SGLang started from it builds its linear layers in block FP8. Removed by ``remove`` (the engine's shutdown)."""

    path: Path

    @classmethod
    def create(cls, hf_dir: str | Path, block: int) -> Fp8ModelDir:
        """``block``: rollout.fp8_block, the config's ``weight_block_size: [block, block]``."""
        src = Path(hf_dir).resolve()
        config = json.loads((src / "config.json").read_text())
        if config.get("quantization_config"):
            raise UserError(f"rollout.weight_dtype = fp8, but {src}/config.json already has a quantization_config "
                            f"({config['quantization_config'].get('quant_method')}): the hand-over quantizes the "
                            "trainer's bf16 weights and needs an unquantized model. Point model.hf_path at the bf16 "
                            "checkpoint, or set rollout.weight_dtype: bf16.")
        path = Path(tempfile.mkdtemp(prefix="megarl-fp8-model-"))
        try:
            for entry in src.iterdir():  # everything but config.json, as it is (tokenizer, generation config, ...)
                if entry.name != "config.json":
                    (path / entry.name).symlink_to(entry)
            config["quantization_config"] = quantization_config(block)
            # SGLang's processes each read config.json: written whole under another name, then renamed.
            tmp = path / ".config.json.tmp"
            tmp.write_text(json.dumps(config, indent=2))
            os.replace(tmp, path / "config.json")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # symlinks only: the model's files stay


def fp8_engine_args(engine_args: dict[str, Any], load_format: str, aliases: object,
                    server_args: set[str]) -> dict[str, Any]:
    """The ``sglang.Engine`` arguments an FP8 engine adds (dummy weights, the Triton runner), after refusing, one
    paragraph each, engine arguments that would break the format. ``server_args``: this SGLang's ServerArgs fields."""
    if RUNNER_ARG not in server_args:
        raise UserError(f"rollout.weight_dtype = fp8 needs an SGLang whose block-FP8 GEMM runner can be chosen "
                        f"({RUNNER_ARG}, in 0.5.17): megarl pins the Triton runner, which reads the weights and "
                        "scales as the hand-over writes them. Install the GPU image's SGLang, or set "
                        "rollout.weight_dtype: bf16.")
    check_fp8_engine_args(engine_args, load_format, aliases)
    return {"load_format": "dummy", RUNNER_ARG: RUNNER} | (
        {} if "attention_backend" in engine_args else {"attention_backend": SCALE_FREE_ATTENTION[0]})


def check_fp8_engine_args(engine_args: dict[str, Any], load_format: str = "auto", aliases: object = None) -> None:
    """Refuse engine arguments an FP8 engine cannot serve (also at start-up: megarl.reshard.planner's
    check_fp8_rollout)."""
    load_format = engine_args.get("load_format", load_format)
    runner = engine_args.get(RUNNER_ARG, RUNNER)
    if runner != RUNNER:
        raise UserError(f"rollout.engine_args.{RUNNER_ARG} = {runner!r} with rollout.weight_dtype = fp8: that "
                        "runner rewrites or re-lays the block scales after loading (DeepGEMM requantizes them to "
                        "UE8M0 or reads its own aligned copy), which a weight update in place would leave stale. "
                        f"Remove it from rollout.engine_args (megarl sets {RUNNER!r}), or set "
                        "rollout.weight_dtype: bf16.")
    if aliases is not None:
        raise UserError("rollout.alias_weights = true with rollout.weight_dtype = fp8: the engine's FP8 linear "
                        "layers cannot map the actor's bf16 tensors. Set rollout.alias_weights: auto (off with fp8) "
                        "or rollout.weight_dtype: bf16.")
    wrong = ({"load_format": load_format} if load_format not in ("auto", "dummy") else {}) | (
        {"quantization": engine_args["quantization"]} if engine_args.get("quantization") not in (None, "fp8") else {})
    if wrong:
        raise UserError(f"rollout.engine_args {wrong} with rollout.weight_dtype = fp8: the engine starts in block "
                        "FP8 with placeholder weights that the first hand-over overwrites; it loads nothing itself "
                        "and takes no other quantization. Remove them from rollout.engine_args, or set "
                        "rollout.weight_dtype: bf16.")
    scaled = {k: engine_args[k] for k in ATTENTION_ARGS if engine_args.get(k) not in (None, *SCALE_FREE_ATTENTION)}
    if scaled:
        raise UserError(f"rollout.engine_args {scaled} with rollout.weight_dtype = fp8: that attention backend scales "
                        "attention by the layers' KV-cache scales, which the FP8 engine's placeholder load leaves as "
                        f"noise that no hand-over writes. Use {' or '.join(SCALE_FREE_ATTENTION)} (megarl sets "
                        f"attention_backend: {SCALE_FREE_ATTENTION[0]} when none is given), or set "
                        "rollout.weight_dtype: bf16.")
    kv = str(engine_args.get("kv_cache_dtype", "auto"))
    if kv.startswith("fp8"):
        # With a quantization_config the attention layers get k_scale / v_scale parameters, which the dummy load
        # fills with noise and no hand-over writes: an FP8 KV cache would be scaled by it.
        raise UserError(f"rollout.engine_args.kv_cache_dtype = {kv!r} with rollout.weight_dtype = fp8: the engine's "
                        "KV-cache scales would be placeholders the hand-over never writes. Remove kv_cache_dtype "
                        "from rollout.engine_args, or set rollout.weight_dtype: bf16.")


def check_block_fp8(model: torch.nn.Module) -> int:
    """In the engine, when a hand-over attaches: every block-FP8 linear layer reads ``weight`` (float8_e4m3fn) and
    ``weight_scale_inv`` (float32, one per block of the ``weight_block_size`` its quant method passes its GEMM,
    row-major) as written, through the Triton runner; returns the number of such layers (0 for a bf16 engine). Raises
    naming the first layer that does not. The layer's own block is the one checked: the engine knows no other (the
    trainer's shows in the shapes its copy checks when attached)."""
    count = 0
    for name, module in model.named_modules():
        scale = getattr(module, "weight_scale_inv", None)
        if not isinstance(scale, torch.Tensor):
            continue
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        runner = getattr(getattr(method, "w8a8_block_fp8_linear", None), "__name__", None)
        block = getattr(method, "weight_block_size", None)  # what SGLang's apply passes the runner
        blocks = None if weight is None or not block else (-(-weight.shape[0] // block[0]),
                                                           -(-weight.shape[1] // block[1]))
        problem = (
            "its weight is not float8_e4m3fn" if weight is None or weight.dtype != torch.float8_e4m3fn else
            f"its scales are {scale.dtype}, not float32" if scale.dtype != torch.float32 else
            "its quant method has no weight_block_size (not block FP8)" if not block else
            f"its scales are {list(scale.shape)}, not {list(blocks or ())} ({block[0]} x {block[1]} blocks, its "
            "weight_block_size)" if tuple(scale.shape) != blocks else
            "its scales were requantized to UE8M0" if getattr(scale, "format_ue8m0", False) else
            "its scales are not contiguous row-major" if not scale.is_contiguous() else
            f"its GEMM runner is {runner}, not {RUNNER_FUNCTION}" if runner != RUNNER_FUNCTION else
            "it keeps a re-laid copy of its scales" if any(hasattr(module, "weight_scale_inv" + s) for s in
                                                          ("_deepgemm", "_shuffled", "_swizzled")) else
            "it runs on Marlin (weight-only FP8)" if getattr(method, "use_marlin", False) else None)
        if problem:
            raise RuntimeError(f"SGLang's block-FP8 layer `{name}` does not read the hand-over's format: {problem}. "
                               f"megarl starts the engine with {RUNNER_ARG}={RUNNER!r}; this SGLang ignored or "
                               "overrode it (rollout.weight_dtype = fp8 needs SGLang 0.5.17's Triton block-FP8 "
                               "path on an sm90 GPU). Set rollout.weight_dtype: bf16.")
        count += 1
    return count

"""actor.lora.handover: adapter on SGLang, on a GPU: an adapter served by SGLangEngine.load_adapter over the base
weights decodes as an engine holding the merged weights W + s B A, and a second adapter really replaces the first.

The model: MEGARL_TEST_HF_MODEL (a Hugging Face directory, e.g. SmolLM2-135M-Instruct), else a tiny random Llama,
in bfloat16 (SGLang 0.5.17's kernels refuse float32), with the triton attention backend and torch sampling, as
tests/test_rollout_sglang_gpu.py starts SGLang. The adapter: random nonzero A and B (rank 16, on q/k/v/o and
gate/up/down, every layer), written as a peft directory.

Tolerance. The two engines compute the same function with different roundings: the merged engine rounds W + s B A
to bfloat16 once per weight (a relative error up to 2^-9 of each element), the LoRA one keeps W exact but runs
W x and s B (A x) as separate bf16 GEMMs (SGLang's csgmv kernels) and adds them. Over every layer that moves a
logit of magnitude 20-30 by about as much as bf16 rounding of it, 0.06-0.12 (the same order as the 0.123 the
resumed-sample test saw between prefill and decode kernels of one set of weights): greedy logprobs must agree within
0.25 wherever the two decodes still agree on the tokens, and they may part only at a near-tie. The adapter itself moves
logprobs by far more than that (checked against the base model), so the bound does tell the adapter from none."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from helpers import make_hf_model
from megarl.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu

RANK, ALPHA = 16, 32.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[3, 17, 42, 8, 120, 11], [100, 5, 9, 77, 31, 2, 54], [64, 64, 1, 19], [7, 300, 12, 12, 45]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
TOL = 0.25
UNSURE = math.log(0.5) + TOL
"""Where two greedy decodes part, neither engine may have given its own token more than about half the mass."""


def random_adapter(base, out, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A peft LoRA directory at ``out`` over the HF model ``base``; the factors by weight name."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    factors, tensors = {}, {}
    for name, weight in base.state_dict().items():
        if not name.endswith(".weight") or name.split(".")[-2] not in MODULES:
            continue
        rows, cols = weight.shape
        a = (torch.randn(RANK, cols, generator=gen) / cols ** 0.5).to(torch.bfloat16)
        b = (torch.randn(rows, RANK, generator=gen) * 0.01).to(torch.bfloat16)
        factors[name] = (a.float(), b.float())  # the merge takes exactly the factors the file holds
        prefix = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{prefix}.lora_A.weight"] = a
        tensors[f"{prefix}.lora_B.weight"] = b
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "use_rslora": False, "bias": "none", "target_modules": list(MODULES), "base_model_name_or_path": "",
        "fan_in_fan_out": False, "init_lora_weights": True}))
    return factors


def start(model: str, tmp_path, **kwargs):
    from megarl.rollout.sglang import SGLangEngine

    return SGLangEngine(model, gpu_memory_fraction=0.3, enable_sleep=False, max_model_len=256,
                        attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                        cuda_graph_max_bs_decode=8, log_file=tmp_path / f"engine_{len(os.listdir(tmp_path))}.log",
                        **kwargs)


def check_close(got, want, what: str) -> None:
    """Greedy decodes of two engines: logprobs within TOL over their common prefix, and where the tokens part,
    each engine unsure of its own pick (a near-tie that rounding may break either way), not one of them sure."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        same = next((t for t, (x, y) in enumerate(zip(g.token_ids, w.token_ids, strict=False)) if x != y),
                    min(len(g.token_ids), len(w.token_ids)))
        gap = max((abs(x - y) for x, y in zip(g.logprobs[:same], w.logprobs[:same], strict=True)), default=0.0)
        assert gap <= TOL, f"{what}: prompt {i}: logprobs {gap:.3f} apart over {same} equal tokens"
        if same < min(len(g.token_ids), len(w.token_ids)):
            picks = (g.logprobs[same], w.logprobs[same])
            assert max(picks) <= UNSURE, (f"{what}: prompt {i} parts after {same} tokens where an engine was sure "
                                          f"of its token (logprobs {picks[0]:.3f}, {picks[1]:.3f}): "
                                          f"{g.token_ids} vs {w.token_ids}")


def test_an_adapter_served_by_sglang_decodes_as_the_merged_weights(tmp_path):
    pytest.importorskip("sglang")
    import transformers

    src = os.environ.get("MEGARL_TEST_HF_MODEL") or str(
        make_hf_model(tmp_path / "tiny", "llama", dtype=torch.bfloat16))
    logs = tmp_path / "logs"
    logs.mkdir()
    base = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    first = random_adapter(base, tmp_path / "adapter_1", seed=1)
    random_adapter(base, tmp_path / "adapter_2", seed=2)
    with torch.no_grad():  # W + s B A, computed in float32 and rounded once, as megarl's merged hand-over does
        params = dict(base.named_parameters())
        for name, (a, b) in first.items():
            params[name].copy_((params[name].float() + ALPHA / RANK * b @ a).to(torch.bfloat16))
    merged_dir = tmp_path / "merged"
    base.save_pretrained(merged_dir, safe_serialization=True)
    for extra in ("generation_config.json",):  # the engine reads the model's EOS ids from it
        if os.path.exists(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), merged_dir / extra)
    del base

    engine = start(src, logs, lora_rank=RANK, lora_targets=["qkv", "o", "fc1", "fc2"])
    try:
        plain = engine.generate(PROMPTS, GREEDY)  # no adapter loaded yet: the base model
        engine.load_adapter(tmp_path / "adapter_1")
        served = engine.generate(PROMPTS, GREEDY)
        engine.load_adapter(tmp_path / "adapter_2")
        second = engine.generate(PROMPTS, GREEDY)
        engine.load_adapter(tmp_path / "adapter_1")  # again, under a new name: the first adapter's output again
        again = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert [c.token_ids for c in again] == [c.token_ids for c in served]
    assert [c.token_ids for c in second] != [c.token_ids for c in served], "the second adapter changed nothing"
    assert [c.token_ids for c in plain] != [c.token_ids for c in served], "the adapter changed nothing"

    engine = start(str(merged_dir), logs)
    try:
        merged = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    check_close(served, merged, "adapter vs merged weights")
    # The tolerance tells an adapter from none: the base model's decodes lie far further from the merged engine's.
    assert max(movement(p, m) for p, m in zip(plain, merged, strict=True)) > 4 * TOL, "the check cannot tell"


def movement(a, b) -> float:
    """How far two greedy decodes lie apart: the largest logprob gap over their common prefix, infinite where they
    part at the first token."""
    same = next((t for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                min(len(a.token_ids), len(b.token_ids)))
    if same == 0:
        return math.inf
    return max(abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same], strict=True))


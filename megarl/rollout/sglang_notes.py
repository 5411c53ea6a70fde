"""What start-up says about SGLang engine arguments that megarl passes through but has seen go wrong."""

from __future__ import annotations

from megarl.config import Config


def deterministic_note(cfg: Config) -> str | None:
    """SGLang 0.5.17 honours per-request seeds only with ``enable_deterministic_inference``, and with it on one H100
    sampled differently: nearly every SmolLM2 sample ran to the token cap (131,056 of 131,072 tokens a rollout
    against 112k without; benchmarks/results/h100/gpu_round_b7ef5c4), which a rollout's rewards and the KL to the
    trainer would only show later. megarl never turns it on; a run that does is told at start-up."""
    if cfg.rollout.engine != "sglang" or not cfg.rollout.engine_args.get("enable_deterministic_inference"):
        return None
    return ("megarl: warning: rollout.engine_args.enable_deterministic_inference = true: with SGLang 0.5.17 on an "
            "H100 it changed what was sampled (nearly every sample ran to the token cap; benchmarks/results/h100/"
            "gpu_round_b7ef5c4). Watch response_length against rollout.max_new_tokens, or remove it (megarl's "
            "per-sample seeds are then ignored by SGLang, the sampling otherwise unchanged).")

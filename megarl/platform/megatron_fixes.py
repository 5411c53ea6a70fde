"""Fixes for megatron-core 0.16 bugs that megarl meets on every device (the CPU-only ones live in cpu_shim).

- MoE without Transformer Engine: ``moe_utils`` binds ``te_general_gemm`` only when TE imports, yet its router
  tests the name unconditionally, so every MoE forward without TE raises NameError. Bound to None, the router
  takes its torch path.
"""

from __future__ import annotations


def fix_moe_without_te() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

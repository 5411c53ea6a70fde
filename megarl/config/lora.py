"""LoraConfig: which of the actor's linear layers get low-rank adapters, of what rank and scale."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Literal

from megarl.config.yaml_io import check

TARGETS = ("qkv", "o", "fc1", "fc2")
"""Megatron's fused query/key/value projection, attention output projection, fused gate/up and down projections."""
TARGET_PATHS = {"qkv": ("self_attention", "linear_qkv"), "o": ("self_attention", "linear_proj"),
                "fc1": ("mlp", "linear_fc1"), "fc2": ("mlp", "linear_fc2")}
"""Where each target sits in a Megatron TransformerLayer: (submodule, linear layer)."""
HF_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "fc1": ("gate_proj", "up_proj"),
              "fc2": ("down_proj",)}
"""The HF (peft) modules of each target: what an engine adapting HF modules adapts for it."""
# peft's target names, to point a user who writes them to ours.
_HF_NAMES = {hf: target for target, names in HF_TARGETS.items() for hf in names}


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """Rank r of each adapter: output = W x + scaling * B A x with A [r, in], B [out, r]. 0 = no adapters. Must be
    below the narrowest in or out width of the target layers (checked against the model at start-up)."""
    alpha: float = 16.0
    """Scale numerator: scaling = alpha / r (alpha / sqrt(r) with rslora)."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    """Linear layers to adapt in every transformer layer: any of qkv, o, fc1, fc2 (HF's q/k/v_proj, o_proj,
    gate/up_proj, down_proj). MoE expert layers (fc1, fc2 of a Qwen3-MoE model) are not supported yet."""
    dropout: float = 0.0
    """Dropout on the adapters' input x (s B A dropout(x)), in the updates only: scoring, the reference and the
    engine see the adapters whole, as peft's eval mode does."""
    rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r, so the update's size does not shrink as r
    grows (Kalajdzievski, 2023)."""
    handover: Literal["merged", "adapter"] = "merged"
    """How the engine gets the trained policy. merged: W + s B A through the resharder after every update, as a
    full-weight actor's. adapter: the engine keeps the base weights it loaded from model.hf_path and serves the
    adapters through its own LoRA support, written as a PEFT adapter after every update (vLLM or SGLang; the actor
    in TP1/PP1; on SGLang not with rslora). docs/training.md compares the two."""

    def __post_init__(self) -> None:
        check(self.rank >= 0, "rank", self.rank, "be >= 0", "use 0 (off) or a rank such as 8 or 16")
        check(math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "be a finite number > 0",
              "use 16, or twice the rank")
        check(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "be in [0, 1)", "use 0.0 (off) or e.g. 0.05")
        for name in self.target_modules:
            close = [_HF_NAMES[name]] if name in _HF_NAMES else difflib.get_close_matches(name, TARGETS, n=1)
            check(name in TARGETS, "target_modules", self.target_modules,
                  f"list only {', '.join(TARGETS)}, not {name!r}",
                  f"use {close[0]!r}" if close else f"pick from {', '.join(TARGETS)}")
        check(len(set(self.target_modules)) == len(self.target_modules), "target_modules", self.target_modules,
              "not repeat a name", "list each module once")
        check(self.rank == 0 or bool(self.target_modules), "target_modules", self.target_modules,
              "name at least one module when rank > 0", f"use {list(TARGETS)}, or rank: 0 for no adapters")
        given = [f.name for f in dataclasses.fields(self) if f.name != "rank" and getattr(self, f.name) != (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)]
        check(self.rank > 0 or not given, "rank", self.rank,
              f"be > 0 where the section sets {', '.join(given)}: rank 0 means no adapters, so those would do "
              "nothing and the whole model would train", "set a rank such as 16, or remove actor.lora for full "
              "fine-tuning")

    @property
    def scaling(self) -> float:
        """The factor s in W x + s * B A x."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

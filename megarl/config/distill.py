"""distill: on-policy distillation, a teacher that scores the student's own samples token by token
(megarl.algos.distill, docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.checks import within


@dataclass(kw_only=True, slots=True)
class DistillConfig:
    teacher: str | None = None
    """HF directory of the teacher: a larger model, or another architecture with the student's tokenizer. Built
    frozen in the trainer's TP/PP layout; null = no distillation."""
    coef: float = 1.0
    """Weight of the per-token reverse KL, log pi_student - log pi_teacher of each sampled token, as a negative
    advantage of that token alone (discount 0), added to the task reward's advantages (none with trainer.reward:
    null)."""
    offload_weights: bool = True
    """Move the teacher's weights to host memory outside the phase that scores with them."""

    def __post_init__(self) -> None:
        within(self, "coef", "(0, inf)", "use 1.0 (Thinking Machines' on-policy distillation), or less to mix it "
               "with the task reward")

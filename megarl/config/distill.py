"""distill: on-policy distillation, a teacher that scores the student's own samples token by token
(megarl.algos.distill, docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from megarl.config.checks import within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class DistillConfig:
    teacher: str | None = None
    """HF directory of the teacher: a larger model, or another architecture with the student's tokenizer. Built
    frozen in the trainer's TP/PP layout; null = no distillation."""
    coef: float = 1.0
    """Weight of the per-token reverse KL, log pi_student - log pi_teacher of each sampled token: a negative
    advantage of that token alone (discount 0), added to the task reward's advantages (none with trainer.reward:
    null), or a loss term's coefficient (form)."""
    form: Literal["advantage", "loss"] = "advantage"
    """advantage: the reverse KL is each token's negative advantage, through the clipped surrogate and the rollout
    correction. loss: coef x the k2 estimate, 0.5 (log pi_student - log pi_teacher)^2 per token, is a loss term
    beside the policy loss, unclipped; on policy its gradient is the advantage form's."""
    offload_weights: bool = True
    """Move the teacher's weights to host memory outside the phase that scores with them."""

    def __post_init__(self) -> None:
        within(self, "coef", "(0, inf)", "use 1.0 (Thinking Machines' on-policy distillation), or less to mix it "
               "with the task reward")
        for name, default in (("coef", 1.0), ("form", "advantage")):
            check(self.teacher is not None or getattr(self, name) == default, name, getattr(self, name),
                  "be left unset while distill.teacher is null: no distillation runs", "set distill.teacher to the "
                  f"teacher's directory, or remove distill.{name}")

    def check_teacher_dir(self) -> None:
        """At start-up, before anything reads the teacher: a model directory, or an error naming this field (the
        model loader's own names the path alone). Not when the config loads: recipes are also checked where their
        models are not."""
        teacher = self.teacher
        missing = "" if teacher is None or Path(teacher).is_dir() else " (there is no such directory)"
        check(teacher is None or (Path(teacher) / "config.json").is_file(), "distill.teacher", teacher,
              f"be a HuggingFace model directory holding config.json, *.safetensors and the student's tokenizer "
              f"files{missing}", "point it at the teacher's directory, or set distill.teacher: null for no "
              "distillation")

"""eval: held-out evaluation during training."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megarl.config.checks import nonempty, positive, within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class EvalDatasetConfig:
    name: str
    """Its metrics' prefix: eval/<name>/accuracy, and its samples' folder eval/<name>/ in the run directory."""
    path: str
    """"gsm8k:test" (vendored) or a .jsonl / .parquet file, read like data.train_path."""
    prompt_key: str | None = None
    """Record field holding the prompt; null = data.prompt_key."""
    answer_key: str | None = None
    """Record field holding the reference answer; null = data.answer_key."""
    prompt_template: str | None = None
    """Format string over the record's fields; null = data.prompt_template."""
    system_prompt: str | None = None
    """System turn before every prompt; null = data.system_prompt, "" = none for this set."""
    response_prefix: str | None = None
    """Text every response starts with; null = data.response_prefix, "" = none for this set."""
    reward: str | None = None
    """Reward function "module:function" scoring the samples; null = trainer.reward."""
    max_prompts: int | None = None
    """Evaluate the first N prompts only; null = all."""
    num_samples: int | None = None
    """Samples per prompt (k of pass@k); null = eval.num_samples."""
    temperature: float | None = None
    """Sampling temperature, 0 = greedy; null = eval.temperature."""
    max_new_tokens: int | None = None
    """Generation length limit; null = eval.max_new_tokens."""

    def __post_init__(self) -> None:
        check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.name)), "name", self.name,
              "be letters, digits, '_', '.' or '-' (it names metrics and a folder)", "use a name such as gsm8k")
        nonempty(self, "path")
        for name in ("max_prompts", "num_samples", "max_new_tokens"):
            value = getattr(self, name)
            check(value is None or value >= 1, name, value, "be null or >= 1", "use null for the default")
        within(self, "temperature", "[0, inf)", "use 0 for greedy decoding (null: eval.temperature)")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Evaluate the weights after every N-th step (0 = only before_train and the final weights); the run always
    ends with an evaluation of its final weights when datasets are given."""
    before_train: bool = False
    """Evaluate the starting weights before the first step."""
    num_samples: int = 1
    """Samples per prompt (k of pass@k and mean@k)."""
    temperature: float = 0.0
    """Sampling temperature, 0 = greedy."""
    max_new_tokens: int | None = None
    """Generation length limit; null = rollout.max_new_tokens (the engine's context allows no more)."""
    datasets: list[EvalDatasetConfig] = field(default_factory=list)
    """Held-out sets, each evaluated on the rollout engines with the weights already handed over; a sample is
    correct when its reward is positive."""

    def __post_init__(self) -> None:
        check(self.every >= 0, "every", self.every, "be >= 0", "use 0 to evaluate only at the ends of the run")
        positive(self, "num_samples")
        within(self, "temperature", "[0, inf)", "use 0 for greedy")
        check(self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens,
              "be null or >= 1", "use null for rollout.max_new_tokens")
        for name, value in (("every", self.every), ("before_train", self.before_train)):
            check(not value or bool(self.datasets), name, value, "be unset when eval.datasets is empty: nothing "
                  "would be evaluated", f"add eval.datasets (a name and a path each), or set eval.{name}: "
                  f"{0 if name == 'every' else 'false'}")
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        check(not dupes, "datasets", dupes, "name every dataset once", "give each dataset its own name")

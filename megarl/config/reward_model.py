"""reward_model: a learned reward model (a HF `*ForSequenceClassification` with one label) that scores every sample
beside the rule reward (megarl.models.reward_model, docs/reward_models.md), or an LLM judge (reward_model.judge:
megarl.loop.judge_phase)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.config.checks import IMPORT_PATH_RE, positive, seeds, within
from megarl.config.yaml_io import check

JUDGE_FIELDS = ("prompt", "response", "answer")
"""What a judge's prompt_template may name: the sample's prompt text, its response text and the data's answer."""


@dataclass(kw_only=True, slots=True)
class JudgeConfig:
    """An LLM judge: a generative model in an engine of its own (rollout.engine's kind), asked about every sample
    through prompt_template; its verdict's text becomes the sample's score by the parse function."""

    model: str
    """HF directory of the judge: a causal LM and its tokenizer (the policy's own directory works too)."""
    prompt_template: str = ("Rate the response to the prompt from 0 (wrong) to 9 (right). Prompt: {prompt}\n"
                            "Response: {response}\nRating:")
    """The judge's user turn, formatted with {prompt} (the prompt's text as the data holds it), {response} (the
    policy's response decoded without special tokens) and {answer} (the data's answer, "" where none); literal
    braces doubled ({{ }}). Rendered with the judge's chat template when apply_chat_template is true and its
    tokenizer has one (a user turn, then the assistant's header), else as plain text."""
    apply_chat_template: bool = True
    """Render the prompt through the judge tokenizer's chat template (when it has one)."""
    parse: str = "megarl.rewards.judge:first_number"
    """"module:function" taking the verdict's text (str) and returning its score (a float), or None when it
    cannot read one: that sample then scores unparsable_score and counts in reward_model/judge_unparsable_fraction.
    A function that raises stops the run with an error naming it (a bug in it is not a verdict)."""
    unparsable_score: float = 0.0
    """The score of a sample whose verdict the parse function cannot read (returns None or a NaN/inf), or whose
    rendered prompt is empty or longer than max_prompt_tokens."""
    max_prompt_tokens: int = 1024
    """Most tokens of a rendered judge prompt; a longer one is not asked (it scores unparsable_score and counts in
    reward_model/judge_unsent_fraction). With max_new_tokens it makes the judge engine's max_model_len."""
    max_new_tokens: int = 16
    """Most tokens of a verdict."""
    temperature: float = 0.0
    """The judge's sampling temperature; 0 = greedy (the same verdict for the same sample)."""
    gpu_memory_fraction: float = 0.1
    """The judge engine's share of GPU memory (vLLM on CPU: of host RAM), beside the rollout engine's. Not in the
    memory plan (docs/memory.md): leave it room in rollout.gpu_memory_fraction's."""
    tensor_parallel: int = 1
    """GPUs of the judge's one engine, which rank 0 drives (the first tensor_parallel GPUs of its node)."""
    seed: int = 0
    """Base sampling seed of the judge (with temperature > 0): its k-th phase since the process started draws from
    seed + k x 100003 on."""

    def __post_init__(self) -> None:
        check(bool(self.model.strip()), "model", self.model, "be non-empty", "name the judge's HF directory")
        try:
            self.prompt_template.format(**{f: "" for f in JUDGE_FIELDS})
        except (KeyError, IndexError, ValueError) as err:
            raise_template(self.prompt_template, err)
        check("{response}" in self.prompt_template, "prompt_template",
              self.prompt_template, "name {response}: the judge must see what it scores",
              'write it like "Prompt: {prompt}\\nResponse: {response}\\nRating:"')
        check(bool(IMPORT_PATH_RE.fullmatch(self.parse)), "parse", self.parse, 'be an import path "module:function"',
              'write it like "megarl.rewards.judge:first_number"')
        check(self.unparsable_score == self.unparsable_score and abs(self.unparsable_score) != float("inf"),
              "unparsable_score", self.unparsable_score, "be a finite number", "use 0.0")
        positive(self, "max_prompt_tokens", "max_new_tokens", "tensor_parallel")
        within(self, "temperature", "[0, inf)", "use 0.0 for greedy verdicts")
        seeds(self, "seed")
        within(self, "gpu_memory_fraction", "(0, 1]", "use 0.1")


def raise_template(template: str, err: Exception) -> None:
    """A prompt_template that str.format cannot fill: the field named, and what it may hold."""
    what = f"names {{{err.args[0]}}}" if isinstance(err, KeyError) else f"is not a format string ({err})"
    check(False, "prompt_template", template, f"name only {', '.join('{' + f + '}' for f in JUDGE_FIELDS)} "
          f"(it {what})", "double literal braces ({{ and }}), and use only those fields")


@dataclass(kw_only=True, slots=True)
class RewardModelConfig:
    path: str | None = None
    """HF directory of a LlamaForSequenceClassification, Qwen2ForSequenceClassification or
    Qwen3ForSequenceClassification with num_labels 1 (Skywork-Reward's format), and its tokenizer. Built frozen in
    the trainer's TP/PP layout; each sample is scored at its last token. null = no reward model."""
    weight: float = 1.0
    """w_rm in a sample's reward r = rule_weight x rule + weight x rm, where rm is the reward model's score
    (normalised and clipped as set below)."""
    rule_weight: float = 1.0
    """rule_weight in r = rule_weight x rule + weight x rm: the weight of trainer.reward's score (0 with
    trainer.reward: null)."""
    normalize: bool = False
    """Standardise the reward model's scores by their running mean and standard deviation over all samples scored
    so far (this step's included) before clip and weight."""
    clip: float | None = None
    """Clip the (normalised) score to [-clip, clip]; null = no clipping."""
    offload_weights: bool = True
    """Move the reward model's weights to host memory outside the phase that scores with them. It scores in the
    actor's micro-batches (actor.max_tokens_per_gpu or actor.micro_batch_size)."""
    judge: JudgeConfig | None = None
    """An LLM judge in place of path, e.g. {model: DIR, prompt_template: ..., parse: "module:function"}: its parsed
    verdict is the score rm above (weight, rule_weight, normalize and clip apply to it as to a reward model's
    score). Not with path (one or the other); not with async_rl or dynamic sampling. null = no judge."""

    def __post_init__(self) -> None:
        check(self.path is None or bool(self.path.strip()), "path", self.path, "be non-empty",
              "name the reward model's HF directory, or null for none")
        within(self, "weight", "[0, inf)", "use 1.0, or less beside a rule reward")
        within(self, "rule_weight", "[0, inf)", "use 1.0, or 0 to train on the reward model alone")
        within(self, "clip", "(0, inf)", "use e.g. 5.0 (in standard deviations with normalize: true), or null")
        check(self.path is None or self.judge is None, "judge", "set", "be null with reward_model.path: a run "
              "scores with a reward model or a judge, not both yet", "drop reward_model.judge, or reward_model.path")
        check(not self.enabled() or self.weight > 0 or self.rule_weight > 0, "weight", self.weight,
              "be > 0 when rule_weight is 0 too: no sample would have a reward",
              "set reward_model.weight: 1.0")

    def enabled(self) -> bool:
        """A reward model (path) or a judge scores the samples."""
        return self.path is not None or self.judge is not None

    def check_dir(self) -> None:
        """At start-up, before anything reads the reward model: a model directory, or an error naming this field.
        Not when the config loads: recipes are also checked where their models are not."""
        path = self.path
        missing = "" if path is None or Path(path).is_dir() else " (there is no such directory)"
        check(path is None or (Path(path) / "config.json").is_file(), "reward_model.path", path,
              f"be a HuggingFace model directory holding config.json, *.safetensors and the tokenizer "
              f"files{missing}", "point it at the reward model's directory, or set reward_model.path: null")

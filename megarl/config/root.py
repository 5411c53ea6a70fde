"""The whole recipe: `Config` of the sections, the checks across sections, and loading it from YAML."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from megarl.config.algorithm import AlgorithmConfig
from megarl.config.async_rl import AsyncConfig
from megarl.config.data import DataConfig
from megarl.config.distill import DistillConfig
from megarl.config.eval import EvalConfig
from megarl.config.experiment import allowed_changes, defines_experiment
from megarl.config.model import ModelConfig, ParallelConfig
from megarl.config.reward_model import RewardModelConfig
from megarl.config.rollout import AgentConfig, RolloutConfig
from megarl.config.run import CheckpointConfig, TrackingConfig, TrainerConfig
from megarl.config.training import ActorConfig, CriticConfig, ReferenceConfig, UpdateConfig
from megarl.config.yaml_io import FieldError, apply_overrides, build, check, flatten, locate, read_yaml

FIXED_AT_START = {"data.seed": "a resume continues the checkpoint's prompt order, drawn from its seed",
                  "trainer.seed": "a resume restores the checkpoint's random state and value head, both drawn "
                                  "from its seed"}
"""Fields of the experiment that a resume cannot change: checkpoint.allow_changes may not name them."""


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig
    """Model to train."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model training (ppo only)."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """Reference model (run when algorithm.kl_coef > 0)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL algorithm and loss."""
    data: DataConfig
    """Prompt dataset."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Run length, seed, reward function."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training (megarl.eval.in_training)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn, tool-using rollouts (megarl.rollout.agent); no tools = single-turn."""
    async_rl: AsyncConfig = field(default_factory=AsyncConfig)
    """Rollouts that overlap the updates (megarl.rollout.inflight, docs/async.md); sync by default."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (docs/algorithms.md); off by default."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model scoring every sample beside trainer.reward (docs/reward_models.md); off by default."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "async": "the section is `async_rl` (async is a Python keyword, which no field can be named)."}

    def __post_init__(self) -> None:
        for key in allowed_changes(self.checkpoint.allow_changes):  # the whole config knows which keys exist
            check(defines_experiment(key, Config), "checkpoint.allow_changes", self.checkpoint.allow_changes,
                  f"name only fields that define the experiment, which `{key}` is not (a layout or run setting, "
                  "free to change on resume, or no field at all)", f"remove `{key}`, or fix its spelling")
            check(key not in FIXED_AT_START, "checkpoint.allow_changes", self.checkpoint.allow_changes,
                  f"not name `{key}`: {FIXED_AT_START.get(key)}, so the change would be announced and not made",
                  f"remove `{key}`, or start a new run with it (another checkpoint.dir, checkpoint.resume: none)")
        for role in ("actor", "critic") if self.algorithm.name == "ppo" else ("actor",):
            warmup = getattr(self, role).optimizer.num_warmup_steps
            check(warmup < self.trainer.num_steps, f"{role}.optimizer.num_warmup_steps", warmup,
                  f"be below trainer.num_steps ({self.trainer.num_steps}): the learning rate would never reach "
                  f"{role}.optimizer.lr", "shorten the warm-up (a few per cent of the run), or use 0")
        n = self.rollout.num_samples_per_prompt
        if self.algorithm.name == "grpo":
            check(
                n >= 2,
                "rollout.num_samples_per_prompt",
                n,
                "be >= 2 for grpo (advantages are rewards relative to the other samples of the prompt)",
                "set rollout.num_samples_per_prompt to 4-16, or algorithm.name: ppo",
            )
        algo = self.algorithm
        check(not algo.dynamic_sampling or algo.name == "grpo", "algorithm.dynamic_sampling", algo.dynamic_sampling,
              "be false for ppo (it selects prompts by the spread of their group's rewards, a grpo notion)",
              "set algorithm.dynamic_sampling: false, or algorithm.name: grpo")
        check(not algo.routing_replay or self.rollout.engine == "sglang", "algorithm.routing_replay",
              algo.routing_replay, f"be false with rollout.engine = {self.rollout.engine}: only SGLang returns the "
              "experts it routed each token to (vLLM 0.32 needs its Model Runner V2, which the CPU build lacks)",
              "use rollout.engine: sglang, or routing_replay: false")
        budget_key = "agent.max_total_tokens" if self.agent.tools and self.agent.max_total_tokens else \
            "rollout.max_new_tokens"
        check(algo.overlong_buffer_tokens <= self.response_budget(), "algorithm.overlong_buffer_tokens",
              algo.overlong_buffer_tokens, f"be <= {budget_key} = {self.response_budget()}, the response budget",
              "use a buffer of about a quarter of max_new_tokens, or 0 to disable the penalty")
        check(not (self.actor.lora_on() and self.model.transformer_engine == "on"), "model.transformer_engine",
              self.model.transformer_engine, "be auto or off with actor.lora: the adapters hook Megatron's local "
              "linear layers, not Transformer Engine's", "set model.transformer_engine: auto (local layers with LoRA)")
        merged_lora = self.actor.lora_on() and not self.actor.adapter_handover()
        check(not (merged_lora and self.rollout.alias_weights is True), "rollout.alias_weights",
              self.rollout.alias_weights, "be auto or false with actor.lora.handover = merged: the engine must hold "
              "the merged weights W + s B A, which no tensor of the actor holds, so it cannot map them",
              "set rollout.alias_weights: auto (off with merged LoRA), actor.lora.handover: adapter (SGLang), or "
              "actor.lora: null")
        if self.actor.adapter_handover():
            par, lora = self.parallel, self.actor.lora
            assert lora is not None
            check(not (self.rollout.engine == "sglang" and lora.rslora), "actor.lora.rslora", lora.rslora,
                  "be false with actor.lora.handover = adapter on SGLang: SGLang 0.5.17 scales every adapter by "
                  "alpha / r and ignores peft's use_rslora, so it would serve another policy",
                  "set actor.lora.rslora: false, or actor.lora.handover: merged")
            check(par.tensor_parallel == 1 and par.pipeline_parallel == 1, "actor.lora.handover", "adapter",
                  f"be merged with parallel.tensor_parallel = {par.tensor_parallel} and pipeline_parallel = "
                  f"{par.pipeline_parallel}: each engine's driver writes the adapters it holds whole (TP1, PP1)",
                  "set actor.lora.handover: merged, or parallel.tensor_parallel and pipeline_parallel to 1")
        budget = self.agent.max_total_tokens
        check(budget is None or budget <= self.rollout.max_new_tokens, "agent.max_total_tokens", budget,
              f"be <= rollout.max_new_tokens = {self.rollout.max_new_tokens}: the engine's context holds no more",
              "raise rollout.max_new_tokens, or use null")
        engine_dtype = self.rollout.engine_args.get("dtype", self.model.dtype)
        check(engine_dtype == self.model.dtype, "rollout.engine_args.dtype", engine_dtype,
              f"equal model.dtype = {self.model.dtype}: the hand-over moves the trainer's bits unchanged, so an engine "
              "in another dtype would read them as other numbers", "remove rollout.engine_args.dtype (the engine "
              "then runs in model.dtype), or change model.dtype")
        check(self.rollout.weight_dtype != "fp8" or self.model.dtype != "float16", "rollout.weight_dtype",
              self.rollout.weight_dtype, "be bf16 with model.dtype = float16: the FP8 hand-over quantizes bfloat16 or "
              "float32 weights (it failed at the first hand-over, after the engine had started)",
              "use model.dtype: bfloat16, or rollout.weight_dtype: bf16")
        self._check_truncation()
        self._check_async()
        check(self.trainer.reward is not None or self.distill.teacher is not None or self.reward_model.enabled(),
              "trainer.reward", None, "name a reward function unless distill.teacher or reward_model.path is set: "
              "without any, no sample has a signal", 'write it like "megarl.rewards.gsm8k:reward", or set '
              "distill.teacher or reward_model.path")
        self._check_reward_model()
        for i, d in enumerate(self.eval.datasets):
            check(d.reward is not None or self.trainer.reward is not None, f"eval.datasets[{i}].reward", None,
                  "name a reward function when trainer.reward is null: held-out accuracy needs one",
                  'write it like "megarl.rewards.gsm8k:reward"')
        self._check_eval()
        self._check_keep_best()
        batch = self.data.num_prompts_per_step * n
        # Sequence parallelism splits every row over the TP ranks: a row's slots are rounded up to them.
        multiple = self.parallel.tensor_parallel if self.parallel.sequence_parallel else 1
        sample = self.rollout.max_prompt_tokens + self.rollout.max_new_tokens
        longest = -(-sample // multiple) * multiple
        rounded = f" ({longest} slots: rows round up to tensor_parallel = {multiple} with sequence_parallel)" \
            if longest != sample else ""
        for name, section in self.trained_sections():
            mini = section.mini_batch_size
            check(
                mini is None or batch % mini == 0,
                f"{name}.mini_batch_size",
                mini,
                f"divide the rollout batch {batch} "
                "(data.num_prompts_per_step * rollout.num_samples_per_prompt)",
                f"pick a divisor of {batch}, or null for one optimizer step per epoch",
            )
            check(
                not section.dynamic_batch or section.max_tokens_per_gpu >= longest,
                f"{name}.max_tokens_per_gpu",
                section.max_tokens_per_gpu,
                f"be >= rollout.max_prompt_tokens + rollout.max_new_tokens = {sample}{rounded} so one sample fits",
                f"raise it to at least {longest} or shorten the rollout limits",
            )

    def _check_reward_model(self) -> None:
        """What the reward model's phase (after generation, before advantages) does not serve yet (the checks that
        need its tokenizer: megarl.loop.bootstrap)."""
        if not self.reward_model.enabled():
            return
        which = "reward_model.path" if self.reward_model.path is not None else "reward_model.judge"
        check(not self.algorithm.dynamic_sampling, "algorithm.dynamic_sampling", True, f"be false with "
              f"{which}: dynamic sampling selects groups by their rewards during generation, before the "
              f"reward model scores them", f"set algorithm.dynamic_sampling: false, or {which}: null")
        check(self.reward_model.judge is None or self.async_rl.mode == "sync", "async_rl.mode", self.async_rl.mode,
              "be sync with reward_model.judge: the judge asks about a step's samples by their prompts' text, which "
              "samples carried across steps do not keep, and its engine would need GPUs beside a generating one",
              "set async_rl.mode: sync, or reward_model.judge: null")

    def _check_async(self) -> None:
        """colocated_async: what its partial rollouts support, and the correction its stale samples need."""
        a, algo, r = self.async_rl, self.algorithm, self.rollout
        # engine_gpus is read in every mode (the launcher holds those GPUs back): checked before sync returns
        check(a.engine_gpus == 0 or a.mode == "separate", "async_rl.engine_gpus", a.engine_gpus,
              f"be 0 with async_rl.mode = {a.mode}: only separate engines keep GPUs of their own",
              "set async_rl.mode: separate, or async_rl.engine_gpus: 0")
        if a.mode == "sync":
            return
        wanted = self.data.num_prompts_per_step
        check(a.in_flight_prompts is None or (a.in_flight_prompts % wanted == 0 and a.in_flight_prompts <= (
              a.max_staleness + 1) * wanted), "async_rl.in_flight_prompts", a.in_flight_prompts,
              f"be a multiple of data.num_prompts_per_step = {wanted} and at most (max_staleness + 1) x that = "
              f"{(a.max_staleness + 1) * wanted}: more could not finish within the staleness bound",
              "use null (the most the bound allows)")
        # separate mode needs max_staleness >= 1 (checked below), so only the correction is a fix there.
        fix = "set algorithm.rollout_correction: token_tis (or seq_geomean_tis)" + (
            "" if a.mode == "separate" else ", or async_rl.max_staleness: 0")
        check(a.max_staleness == 0 or algo.rollout_correction != "none", "algorithm.rollout_correction", "none",
              f"name a correction with async_rl.mode = {a.mode} and max_staleness = {a.max_staleness}: a sample "
              "drawn by older weights needs its importance weight to the policy being trained (decoupled PPO: the "
              "engine's logprobs are the behaviour policy, the trainer's old logprobs the proximal one)", fix)
        check(a.mode != "separate" or self.rollout.alias_weights is not True, "rollout.alias_weights", True,
              "be auto or false with async_rl.mode = separate: the engine generates while the learner updates, so "
              "it must hold its own copy of the weights", "set rollout.alias_weights: auto (off in this mode)")
        check(a.mode != "separate" or a.max_staleness >= 1, "async_rl.max_staleness", a.max_staleness,
              "be >= 1 with async_rl.mode = separate: the engine generates with the weights of the step before",
              "set async_rl.max_staleness: 1 (one-step-off) or more")
        check(a.engine_gpus == 0 or r.engine == "vllm", "async_rl.engine_gpus", a.engine_gpus,
              "be 0 with rollout.engine = sglang: SGLang's schedulers do not join the hand-over group yet",
              "set rollout.engine: vllm, or async_rl.engine_gpus: 0 (the engine beside the trainer)")
        check(a.engine_gpus % r.tensor_parallel == 0, "async_rl.engine_gpus", a.engine_gpus,
              f"be a multiple of rollout.tensor_parallel = {r.tensor_parallel}: each engine spans that many GPUs",
              f"use {max(1, a.engine_gpus // r.tensor_parallel) * r.tensor_parallel}")
        for ok, key, value, why, fix in [
            (not self.agent.tools, "agent.tools", "[...]", "multi-turn samples do not resume from a partial turn yet",
             "use async_rl.mode: sync with tools"),
            (not algo.dynamic_sampling, "algorithm.dynamic_sampling", True, "its rounds are the sync loop's",
             "set algorithm.dynamic_sampling: false, or async_rl.mode: sync"),
            (not algo.routing_replay, "algorithm.routing_replay", True, "a resumed sample's experts are not joined "
             "across its chunks yet", "set algorithm.routing_replay: false, or async_rl.mode: sync")]:
            check(ok, key, value, f"be unset with async_rl.mode = {a.mode}: {why}", fix)

    def num_engines(self, world: int) -> int:
        """Rollout engines of a run of ``world`` trainer ranks: one per rollout.tensor_parallel GPUs, the trainer's
        or (async_rl.engine_gpus) their own."""
        return max(1, (self.async_rl.engine_gpus or world) // self.rollout.tensor_parallel)

    def host_group_timeout(self) -> timedelta:
        """The timeout of the gloo groups whose collectives wait out a generation round (its results' gather, the
        engines' groups, the judge's): an engine call's own deadline (rollout.timeout_minutes), which names the
        call, then a collective's (parallel.timeout_minutes). torch's default of 30 minutes ignored both."""
        return timedelta(minutes=self.rollout.timeout_minutes + self.parallel.timeout_minutes)

    def response_budget(self) -> int:
        """Most tokens of a training response: agent.max_total_tokens with tools (policy and tool tokens), else
        rollout.max_new_tokens."""
        if self.agent.tools and self.agent.max_total_tokens:
            return self.agent.max_total_tokens
        return self.rollout.max_new_tokens

    def _check_eval(self) -> None:
        """Evaluation runs on the rollout engines, whose context is max_prompt_tokens + max_new_tokens."""
        limit = self.rollout.max_new_tokens
        for where, value in [("eval.max_new_tokens", self.eval.max_new_tokens)] + [
                (f"eval.datasets[{i}].max_new_tokens", d.max_new_tokens) for i, d in enumerate(self.eval.datasets)]:
            check(value is None or value <= limit, where, value, f"be <= rollout.max_new_tokens = {limit}: the "
                  "engines' context holds no more", f"raise rollout.max_new_tokens, or lower {where}")
        for i, d in enumerate(self.eval.datasets):
            k = d.num_samples or self.eval.num_samples
            t = self.eval.temperature if d.temperature is None else d.temperature
            check(k == 1 or t > 0, f"eval.datasets[{i}].num_samples", k, f"be 1 at temperature {t}: greedy samples "
                  "are all the same", "set a temperature > 0 for pass@k, or num_samples: 1")

    def _check_keep_best(self) -> None:
        best, e, c = self.checkpoint.keep_best, self.eval, self.checkpoint
        if best is None:
            return
        names = [d.name for d in e.datasets]
        parts = best.split("/")
        check(len(parts) == 3 and parts[0] == "eval" and parts[1] in names, "checkpoint.keep_best", best,
              f"name a held-out metric eval/<name>/<metric> of an eval dataset ({', '.join(names) or 'none given'})",
              "write e.g. eval/<name>/accuracy, with that name under eval.datasets")
        k = e.datasets[names.index(parts[1])].num_samples or e.num_samples
        # The best is the highest: mean_length and truncated_fraction, which eval/ also logs, have no better end
        # that keep_best could keep (it kept the most truncated step's checkpoint and let the least go).
        metrics = ["accuracy", *([f"pass@{k}", f"mean@{k}"] if k > 1 else [])]
        check(parts[2] in metrics, "checkpoint.keep_best", best, f"name a metric of eval/{parts[1]} where higher is "
              f"better: {', '.join(metrics)} (a misspelled one is never logged, so no checkpoint would be kept)",
              f"write e.g. eval/{parts[1]}/accuracy")
        check(c.save_every > 0 and (e.every == 0 or c.save_every % e.every == 0), "checkpoint.save_every",
              c.save_every, f"be a multiple of eval.every = {e.every} with checkpoint.keep_best, so that saved steps "
              "are evaluated", f"set checkpoint.save_every to a multiple of {e.every or 1}")

    def _check_truncation(self) -> None:
        """top_p / top_k: the engine samples from the truncated distribution, the trainer scores the full one."""
        r = self.rollout
        for name, off in (("top_p", 1.0), ("top_k", -1)):
            value = getattr(r, name)
            check(value == off or r.engine == "vllm", f"rollout.{name}", value, f"be {off} with SGLang: it samples "
                  "from the truncated distribution but returns log-probabilities of the full one (measured with "
                  "SGLang 0.5.17 on an H200: they match the full softmax(logits / T) to 0.013 nats, while the policy "
                  "it samples from differs by 0.10 nats per token at top_p 0.9 and 0.45 at top_k 20, "
                  "benchmarks/results/h200/reliability), so neither the trainer, the logprob drift check nor a "
                  "rollout correction would see the policy the samples came from",
                  f"set rollout.{name}: {off}, and lower rollout.temperature for less varied samples")
            check(value == off or self.algorithm.rollout_correction != "none", f"rollout.{name}", value,
                  f"be {off} without algorithm.rollout_correction: vLLM samples from the truncated distribution and "
                  "returns its log-probabilities, which differ from the trainer's full softmax(logits / T) by the "
                  "log of the mass kept (0.10 nats per token at top_p 0.9), so the update would be off-policy "
                  "uncorrected", f"set algorithm.rollout_correction: token_tis, or rollout.{name}: {off}")

    def trained_sections(self) -> list[tuple[str, UpdateConfig]]:
        """The (name, section) of each model trained by the algorithm: actor, plus critic for ppo."""
        sections: list[tuple[str, UpdateConfig]] = [("actor", self.actor)]
        if self.algorithm.name == "ppo":
            sections.append(("critic", self.critic))
        return sections

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_flat_dict(self) -> dict[str, Any]:
        """{"actor.optimizer.lr": 1e-06, ...}: one entry per leaf, e.g. for mlflow params."""
        return flatten(self.to_dict())


def build_config(
    data: Mapping[str, Any], overrides: Sequence[str] = (), origins: Mapping[str, str] | None = None
) -> Config:
    """Build a Config from a parsed-YAML mapping plus `dotted.key=value` overrides.

    `origins` maps dotted keys to where they were written (`file line N`), for error messages.
    """
    located = dict(origins or {})
    merged = apply_overrides(dict(data), overrides, located)
    try:
        return build(Config, merged)
    except FieldError as err:
        raise locate(err, located) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML recipe, apply `--set` overrides, and return the checked Config."""
    data, origins = read_yaml(path)
    return build_config(data, overrides, origins)


def run_dir(cfg: Config) -> Path:
    """Where a run writes metrics, the mlflow store, checkpoints and engine logs."""
    return Path(cfg.checkpoint.dir or "runs/latest")

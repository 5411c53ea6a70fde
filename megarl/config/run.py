"""trainer:, checkpoint: and tracking: the run's length, seeds, checkpoints and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.checks import IMPORT_PATH_RE, nonempty, positive, seeds, within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    num_steps: int = 100
    """RL steps (rollout + update) to run."""
    seed: int = 0
    """Seed for parameter initialisation (value head) and any trainer-side randomness."""
    reward: str | None = "megarl.rewards.gsm8k:reward"
    """Reward function as "module:function"; imported when training starts. null = no task reward (on-policy
    distillation alone: distill.teacher). Each training process scores its share of a step's samples and all
    train on every score."""
    reward_workers: int = 0
    """Processes that run the reward function beside each training process; 0 = in the training process. With N,
    a batch is scored in N parts at once, and with async_rl each group as soon as its samples are done, while the
    engine generates the rest: off the learner's path in async_rl.mode separate. Worth it for costly verifiers
    (math-verify: about 1.6 ms a GSM8K sample, 0.8 s a step of 512); each worker imports the reward's module."""
    log_every: int = 1
    """Console progress every this many steps (metrics go to tracking every step)."""
    log_samples: int = 0
    """Every this many steps (from the first), the step's samples go to RUN/samples/step_N.jsonl (N from 0; RUN is
    checkpoint.dir, else runs/latest), one JSON line each: prompt, response, response_tokens, each reward, the
    multi-turn statistics and the advantage, to read what the policy is rewarded for; 0 = never."""

    def __post_init__(self) -> None:
        positive(self, "num_steps", "log_every")
        seeds(self, "seed")
        within(self, "reward_workers", "[0, inf)", "use 0 to score in the training process")
        within(self, "log_samples", "[0, inf)", "use 0 to write no samples")
        check(self.reward is not None or self.reward_workers == 0, "reward_workers", self.reward_workers,
              "be 0 without trainer.reward (there is nothing to score)", "remove trainer.reward_workers")
        check(
            self.reward is None or bool(IMPORT_PATH_RE.fullmatch(self.reward)),
            "reward",
            self.reward,
            'be an import path "package.module:function"',
            'write it like "megarl.rewards.gsm8k:reward"',
        )


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory; null = no checkpoints."""
    save_every: int = 0
    """Save every this many steps (and at the end); 0 = only when stop_file asks (start-up warns a run of 20 steps
    or more: a crash or a preemption would restart it from step 0)."""
    keep_last: int = 2
    """Checkpoints to keep; older ones are deleted after a successful save (never the one just saved, nor
    any of a later step)."""
    resume: str = "auto"
    """auto = the newest checkpoint in dir that verifies against its manifest, if any (damaged ones are
    passed over, with a line, and renamed *.damaged); none = start fresh, in a dir that holds no checkpoint (an
    earlier run's would mix with the new run's); otherwise a checkpoint path, which must verify. A job Slurm
    requeued (SLURM_RESTART_COUNT > 0) whose dir holds a checkpoint resumes as auto, whatever this says."""
    stop_file: str | None = None
    """Once this file exists, training saves a checkpoint after the current step, deletes the file and
    exits with code 0; null = STOP in dir (off without a dir). The Slurm scripts create it when Slurm
    signals the end of the time limit or a preemption (--signal)."""
    keep_best: str | None = None
    """A held-out metric where higher is better (accuracy, pass@k, mean@k), e.g. eval/gsm8k/accuracy: the
    checkpoint of the step that scored highest on it stays
    outside keep_last's rotation (best.json in dir names it). Needs save_every to be a multiple of eval.every,
    so that saved steps are evaluated; null = none."""
    allow_changes: str | None = None
    """Fields that define the experiment (model, dtype, algorithm, reward, data, sampling, batch shape,
    optimizer, rollout.seed) which a resume may change from the checkpoint's values, as dotted keys separated by
    commas, e.g. "rollout.num_samples_per_prompt, data.num_prompts_per_step"; null = none: a changed one stops
    the resume naming each. Not data.seed or trainer.seed: a resume restores the prompt order and random state
    drawn from them. The layout (parallel.*, the distributed optimizer) may always change."""

    def __post_init__(self) -> None:
        within(self, "save_every", "[0, inf)", "use 0 to save only when a stop file asks")
        check(self.stop_file is None or self.dir is not None, "stop_file", self.stop_file,
              "come with checkpoint.dir (a stop saves a checkpoint)", "set checkpoint.dir or stop_file: null")
        check(
            self.save_every == 0 or self.dir is not None,
            "dir",
            self.dir,
            f"be set when save_every is {self.save_every}",
            "set checkpoint.dir or save_every: 0",
        )
        positive(self, "keep_last")
        nonempty(self, "resume")


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    backend: Literal["mlflow", "none"] = "mlflow"
    """Experiment tracker; none = console and metrics.jsonl only."""
    uri: str | None = None
    """MLflow tracking URI, e.g. sqlite:////abs/path/mlflow.db or http://host:5000; null = a SQLite store
    mlflow.db in checkpoint.dir (runs/latest without one), beside metrics.jsonl."""
    experiment: str = "megarl"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null = generated."""

    def __post_init__(self) -> None:
        nonempty(self, "experiment")
        if self.uri is not None:
            nonempty(self, "uri")

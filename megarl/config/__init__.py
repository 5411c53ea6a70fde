"""Typed configuration: one dataclass per YAML section, checked when built.

A recipe maps 1:1 onto `Config`; `load_config` reads it, applies `--set key=value` overrides and rejects
unknown keys, wrong types and out-of-range values with an error naming the dotted key and where it was
set. Checks that need the world size or the model's shape live in `validate_layout`.

`__post_init__` errors name fields relative to their own section; `yaml_io.build` prefixes the path
(`lr` -> `actor.optimizer.lr`), so construct configs through `load_config`/`build_config` for full paths.

One module per group of sections (model, training, rollout, algorithm, data, run, eval, lora, async_rl, distill,
reward_model);
`root` holds `Config`, `layout` the checks against the world size, `yaml_io` the mapping of YAML onto
dataclasses, `reference` the generated docs/configuration.md, `experiment` the keys a resume must not change.
"""

from megarl.config.algorithm import AlgorithmConfig
from megarl.config.async_rl import AsyncConfig
from megarl.config.data import DataConfig
from megarl.config.distill import DistillConfig
from megarl.config.eval import EvalConfig, EvalDatasetConfig
from megarl.config.layout import validate_layout
from megarl.config.lora import LoraConfig
from megarl.config.model import ModelConfig, ParallelConfig
from megarl.config.reward_model import RewardModelConfig
from megarl.config.rollout import AgentConfig, RolloutConfig, ToolConfig
from megarl.config.root import Config, build_config, load_config, run_dir
from megarl.config.run import CheckpointConfig, TrackingConfig, TrainerConfig
from megarl.config.training import ActorConfig, CriticConfig, OptimizerConfig, ReferenceConfig, UpdateConfig

__all__ = [
    "ActorConfig", "AgentConfig", "AlgorithmConfig", "AsyncConfig", "CheckpointConfig", "Config", "CriticConfig",
    "DataConfig", "DistillConfig", "EvalConfig", "EvalDatasetConfig", "LoraConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "ReferenceConfig", "RewardModelConfig", "RolloutConfig", "TrackingConfig", "TrainerConfig",
    "ToolConfig",
    "UpdateConfig",
    "build_config", "load_config", "run_dir", "validate_layout",
]

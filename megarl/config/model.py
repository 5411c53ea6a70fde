"""model: and parallel: the model to train and the trainer's parallel layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.config.checks import nonempty, positive, within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    hf_path: str
    """HuggingFace model directory: config.json, *.safetensors and the tokenizer files."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Parameter and activation dtype for training; the rollout engine uses the same."""
    vocab_pad_multiple: int = 128
    """Megatron pads the vocabulary to a multiple of this times tensor_parallel."""
    transformer_engine: Literal["auto", "on", "off"] = "auto"
    """Use Transformer Engine layers: auto = when installed and on GPU (not with actor.lora, which adapts the local
    layers); on = required; off = local layers."""
    recompute_activations: bool = False
    """Recompute transformer-layer activations in backward to save memory (about 30% more compute)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models (Qwen3-MoE): weight of the router's load-balancing loss in the actor's loss (0 = none, as RL
    fine-tuning usually runs; pretraining used 0.001)."""
    logprob_chunk_tokens: int = 1024
    """Log-probabilities and entropy (actor update, scoring, reference) from the output layer's input, this many
    tokens at a time: the micro-batch's [tokens x vocab] logits never exist, only one chunk's, and backward makes
    each chunk's again (docs/memory.md). 0 = from Megatron's full logits."""

    def __post_init__(self) -> None:
        nonempty(self, "hf_path")
        positive(self, "vocab_pad_multiple")
        within(self, "logprob_chunk_tokens", "[0, inf)", "use 1024, or 0 for the full logits")
        within(self, "moe_aux_loss_coeff", "[0, inf)", "use 0 (no load-balancing loss) or a small weight, 0.001")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """Megatron tensor-parallel size (TP) of the trainer."""
    pipeline_parallel: int = 1
    """Megatron pipeline-parallel size (PP) of the trainer."""
    virtual_pipeline: int | None = None
    """Interleaved pipeline chunks per PP stage (needs pipeline_parallel > 1); null = not interleaved."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism for norms/dropout (needs tensor_parallel > 1)."""
    data_parallel: int | None = None
    """Data-parallel size; null = world size / (TP * PP). When set it must equal that."""
    expert_parallel: int = 1
    """MoE models: the ranks each layer's experts are split over, carved out of data_parallel (Megatron's expert
    parallelism, expert TP = TP); it divides data_parallel and the expert count. 1 = every DP rank holds every
    expert."""
    rank_order: Literal["tp-dp-pp", "tp-pp-dp"] = "tp-dp-pp"
    """Order in which ranks are assigned to parallel groups, fastest-varying first (Megatron's order)."""
    gpus_per_node: int | None = None
    """GPUs per node for placing groups; null = LOCAL_WORLD_SIZE from torchrun."""
    timeout_minutes: int = 30
    """Collective timeout, so a hung rank fails the job instead of burning GPU hours. The gloo groups whose
    collectives wait out a generation round (its results' gather, the engines') take rollout.timeout_minutes more."""
    nvlink_gbps: float = 365.0
    """GB/s each direction between two GPUs of a node, for the hand-over's predicted time (365: NCCL over an
    H200's NV18 NVLink, measured)."""
    network_gbps: float = 50.0
    """GB/s each direction from one GPU to another node, for the hand-over's predicted time (50: one 400 Gb/s
    InfiniBand NDR or RoCE NIC per GPU; not measured here)."""

    def __post_init__(self) -> None:
        positive(
            self, "tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel", "gpus_per_node",
            "timeout_minutes"
        )
        within(self, "nvlink_gbps", "(0, inf)", "use the link's measured rate, e.g. 365 for H200 NVLink")
        within(self, "network_gbps", "(0, inf)", "use the NIC's rate per GPU in GB/s, e.g. 50 for 400 Gb/s")
        check(self.expert_parallel == 1 or self.rank_order == "tp-dp-pp", "expert_parallel", self.expert_parallel,
              f"be 1 with rank_order {self.rank_order} (experts are split over consecutive DP ranks)",
              "set rank_order: tp-dp-pp, or expert_parallel: 1")
        within(self, "virtual_pipeline", "[2, inf)", "use null for a plain (non-interleaved) pipeline")
        check(
            self.virtual_pipeline is None or self.pipeline_parallel > 1,
            "virtual_pipeline",
            self.virtual_pipeline,
            f"be null when pipeline_parallel is {self.pipeline_parallel}",
            "set pipeline_parallel > 1 or virtual_pipeline: null",
        )
        check(
            not self.sequence_parallel or self.tensor_parallel > 1,
            "sequence_parallel",
            self.sequence_parallel,
            "be false when tensor_parallel is 1 (it shards activations over TP ranks)",
            "set tensor_parallel > 1 or sequence_parallel: false",
        )

"""megarl: RL post-training of LLMs on megatron-core with colocated SGLang/vLLM rollouts."""

__version__ = "0.1.0"

"""Llama and Qwen2 as megatron-core GPTModels, built from HuggingFace config.json and safetensors."""

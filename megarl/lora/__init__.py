"""LoRA adapters on the actor's Megatron linear layers, sharded over tensor parallelism as the layers they adapt
(not yet used by the trainer, checkpoints or the hand-over)."""

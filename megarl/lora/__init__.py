"""LoRA adapters on the actor's Megatron linear layers, sharded over tensor parallelism as the layers they adapt
(layers.py), and their wiring into training (training.py: the actor's adapters; the reference is the actor with its
adapters off, the engine receives merged weights), checkpoints (checkpoint.py) and PEFT exports (export.py). Their
config section is megarl.config.lora."""

"""LoRA adapters on the actor's Megatron linear layers, sharded over tensor parallelism as the layers they adapt
(layers.py), and their wiring into training (training.py: actor.lora; the reference is the actor with its adapters
off, the engine receives merged weights, checkpoints hold the adapters)."""

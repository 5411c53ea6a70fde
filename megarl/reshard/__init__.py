"""Zero-redundancy resharding: Megatron TP/PP shards -> rollout engines' per-rank layout."""

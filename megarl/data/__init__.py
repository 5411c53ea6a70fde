"""Prompt datasets (vendored GSM8K, jsonl, parquet), tokenization, token-budget batching, packing."""

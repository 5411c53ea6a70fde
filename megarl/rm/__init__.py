"""Reward-model training (`python -m megarl.train_rm`): Bradley-Terry on preference pairs, on megatron-core.

``pairs`` renders the pairs into token ids as the policy's samples look; ``trainer`` builds the model, scores,
steps and evaluates. The Bradley-Terry loss is megarl.algos.preference; the pairs' file format is
megarl.data.preferences; the export to a HF `*ForSequenceClassification` is `python -m megarl.convert mcore-to-hf`.
"""

"""Held-out evaluation: one timed generate-and-score (harness), run during training (in_training) and by the
standalone `python -m megarl.evaluate`."""

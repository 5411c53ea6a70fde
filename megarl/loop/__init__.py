"""The training loop's parts: setup of a run (bootstrap), the RL trainer (rollout, scoring, updates, hand-over)
and the step's tensor glue (rl_step)."""

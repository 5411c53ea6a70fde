"""RL algorithms as pure tensor functions: advantages (GAE, GRPO), PPO losses, KL estimators and control."""

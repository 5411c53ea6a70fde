"""algorithm: the RL objective (advantages, clipping, KL, entropy, corrections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarl.config.checks import positive, within
from megarl.config.yaml_io import check


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    name: Literal["ppo", "grpo"] = "grpo"
    """ppo = KL-PPO with a critic and GAE; grpo = group-normalised rewards, no critic."""
    gamma: float = 1.0
    """Discount factor for GAE (ppo)."""
    gae_lambda: float = 1.0
    """GAE lambda (ppo)."""
    clip_ratio_low: float = 0.2
    """Lower PPO clip: the ratio is clipped below at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper PPO clip: the ratio is clipped above at 1 + clip_ratio_high (raise it for clip-higher)."""
    dual_clip_c: float | None = None
    """Dual-clip bound c > 1 on the loss of negative-advantage tokens; null = off."""
    value_clip: float | None = 0.2
    """Clip of value predictions around the old values (ppo); null = off."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    kl_coef: float = 0.0
    """KL(policy || reference) weight; 0 = no reference model is run. Initial value when adaptive_kl."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """Per-token KL estimator (Schulman's k1, k2, k3); null = by where the KL goes: k1 in the reward (its
    score-function gradient is that of KL(policy || reference)), k3 in the loss (as GRPO; its gradient there is that
    of KL(reference || policy), while k2's is KL(policy || reference)'s). k1 is refused in the loss: the gradient of
    log pi - log pi_ref over the policy's own samples is zero in expectation, so it would log a KL and hold nothing
    back."""
    kl_in_reward: bool = False
    """Subtract the KL penalty (kl_estimator, times kl_coef) from the reward instead of adding it to the loss:
    per token for ppo (classic RLHF), summed over the response from the score before group normalisation for grpo."""
    adaptive_kl: bool = False
    """Adapt kl_coef towards kl_target (Ziegler et al.)."""
    kl_target: float | None = None
    """Target of the measured KL for adaptive_kl: the per-token mean of the KL estimate over response tokens."""
    kl_horizon: int = 10000
    """Horizon, in samples, of the adaptive KL controller."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                              "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are reduced to one number, over each mini-batch's tokens that count (not those of
    filler groups or rejected sequences): token-mean = sum / number of tokens (DAPO); seq-mean-token-mean = mean
    per sequence, then over sequences (the original GRPO); seq-mean-token-sum = sum per sequence, then mean over
    sequences (grows with response length); seq-mean-token-sum-norm = sum per sequence divided by the constant
    rollout.max_new_tokens, then mean over sequences (Dr. GRPO, Liu et al. 2025: no length-dependent
    normaliser)."""
    grpo_std_normalize: bool = True
    """Divide group-centred rewards by the group std (false = Dr. GRPO)."""
    rollout_correction: Literal["none", "token_tis", "seq_product_tis", "seq_product_mis", "seq_geomean_tis",
                                "seq_geomean_mis"] = field(default="none", metadata={"retired": {
        "seq_tis": "use `seq_geomean_tis` for the same weights (the geometric mean of the token ratios, which stays "
                   "near 1 on long responses, so a cap of 2 hardly ever acts), or `seq_product_tis` for the "
                   "sequence's importance ratio, bounded by rollout_correction_product_cap",
        "seq_mis": "use `seq_geomean_mis` for the same rejections (by the geometric mean of the token ratios, "
                   "which stays near 1 on long responses), or `seq_product_mis` for rejection by the sequence's "
                   "importance ratio, bounded by rollout_correction_product_cap"}})
    """Correct for the engine's sampling distribution differing from the trainer's (kernels, bf16, FP8) by
    weighting each token's loss with the ratio pi_trainer / pi_rollout: token_tis = per-token ratio truncated
    at rollout_correction_cap; seq_product_tis = the sequence's ratio (the product of its token ratios, verl's
    sequence level), truncated at rollout_correction_product_cap; seq_product_mis = that ratio, with sequences
    outside [1/cap, cap] rejected (out of the loss and its denominators); seq_geomean_tis / seq_geomean_mis =
    the same with the geometric mean of the token ratios and rollout_correction_cap; none = off."""
    rollout_correction_cap: float = 2.0
    """Truncation (tis) or rejection (mis, outside [1/C, C]) bound C > 1 of the token and geometric-mean ratios.
    For the seq_geomean modes keep it tight (1.01 to 1.1): a geometric mean over hundreds of tokens stays
    within a few per cent of 1."""
    rollout_correction_product_cap: float = 2.0
    """Truncation (seq_product_tis) or rejection (seq_product_mis, outside [1/C, C]) bound C > 1 of the
    sequence's importance ratio, which spreads with response length (verl's default, 2; raise it for long
    responses)."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling (grpo): drop prompts whose samples all got the same reward (no signal) and
    generate more until data.num_prompts_per_step prompts with signal are found."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most with dynamic_sampling, the first included; if they find too few
    prompts with signal, the batch is filled up with dropped ones (advantage 0)."""
    overlong_buffer_tokens: int = 0
    """DAPO soft overlong penalty: a response longer than its budget (rollout.max_new_tokens; with tools
    agent.max_total_tokens, tool tokens counted) - overlong_buffer_tokens loses reward linearly, overlong_penalty at
    the limit; 0 = off."""
    overlong_penalty: float = 1.0
    """Reward lost by a response that reaches its budget, with overlong_buffer_tokens > 0."""
    routing_replay: bool = False
    """MoE models: the actor's routers use the experts the engine routed each token to (the engine returns them;
    SGLang only), in the old-logprob pass and the updates, so trainer and engine agree on expert choice. The
    router's probabilities and gradients stay its own. Logs routing/disagreement: the share of expert choices
    the trainer would have made otherwise."""

    def __post_init__(self) -> None:
        within(self, "gamma", "[0, 1]", "use 1.0 (usual for LLM RL)")
        within(self, "gae_lambda", "[0, 1]", "use 1.0 (usual for LLM RL)")
        within(self, "clip_ratio_low", "(0, 1)", "use 0.2")
        within(self, "clip_ratio_high", "(0, inf)", "use 0.2 (or 0.28 for clip-higher)")
        within(self, "dual_clip_c", "(1, inf)", "use 3.0, or null to disable dual clipping")
        within(self, "value_clip", "(0, inf)", "use 0.2, or null to disable value clipping")
        within(self, "entropy_coef", "[0, inf)", "use 0 to disable the entropy bonus")
        within(self, "kl_coef", "[0, inf)", "use 0 to disable the KL penalty")
        positive(self, "kl_horizon", "dynamic_sampling_max_rounds")
        if self.kl_estimator is None:
            self.kl_estimator = "k1" if self.kl_in_reward else "k3"
        check(self.kl_in_reward or self.kl_estimator != "k1" or (self.kl_coef == 0 and not self.adaptive_kl),
              "kl_estimator", self.kl_estimator, "not be k1 with the KL in the loss (kl_in_reward: false): its "
              "gradient over the policy's own samples is zero in expectation, so the penalty would hold nothing back",
              "use k3 (or k2) in the loss, or set kl_in_reward: true, where k1 is the right estimator")
        within(self, "rollout_correction_cap", "(1, inf)", "use 2.0")
        within(self, "rollout_correction_product_cap", "(1, inf)", "use 2.0")
        within(self, "overlong_buffer_tokens", "[0, inf)", "use 0 to disable the overlong penalty")
        within(self, "overlong_penalty", "[0, inf)", "use 1.0")
        if self.adaptive_kl:
            check(
                self.kl_target is not None and 0 < self.kl_target < float("inf"),
                "kl_target",
                self.kl_target,
                "be > 0 when adaptive_kl is true",
                "set kl_target (e.g. 0.1) or adaptive_kl: false",
            )
            check(
                self.kl_coef > 0,
                "kl_coef",
                self.kl_coef,
                "be > 0 when adaptive_kl is true (the controller scales it)",
                "set an initial kl_coef such as 0.05",
            )

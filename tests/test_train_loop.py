"""The RL loop's wiring, one process, no Megatron and no engine: megarl/train.py's main() runs against a trainer
that records what it is given, and Learner.optimize splits mini-batches over data-parallel ranks recorded
one rank at a time. What is checked is what a swapped argument or a per-rank normalisation would break: the
importance weights are pi_old / pi_rollout, step 0 refuses an engine that does not run the trainer's weights,
and every optimizer step's token weights add up, over the DP ranks, to the aggregation of its whole mini-batch."""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from megarl import train
from megarl.algos.kl import FixedKLController
from megarl.config import ActorConfig, AlgorithmConfig, Config, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from megarl.errors import UserError
from megarl.loop.learner import Learner
from megarl.loop.rl_step import Batch

# Trainer (pi_old) minus engine (pi_rollout) log-probabilities of each response token: ratios 1.5, 0.8, 3
# (over the cap of 2) and 0.6; swapped they would be 0.67, 1.25, 0.33, 1.67.
LOG_RATIOS = [[math.log(1.5), math.log(0.8)], [math.log(3.0), math.log(0.6)]]


class RecordingTrainer:
    """What train.py calls on RLTrainer; the batch's engine logprobs are ``rollout``, the actor's ``old``."""

    def __init__(self, batch: Batch, old: torch.Tensor, kl_coef: float) -> None:
        self.batch, self.old = batch, old
        self.ref = (old - 0.25) * batch.mask
        self.actor, self.reference, self.critic, self.teacher = object(), object() if kl_coef else None, None, None
        self.kl = FixedKLController(kl_coef)
        self.groups = SimpleNamespace(rank=0, device=torch.device("cpu"))
        self.updates: list[dict[str, torch.Tensor]] = []

    def generate(self, next_prompts, step):
        return self.batch, {}

    reward_model = None  # reward_model.path null

    def score_rewards(self, batch):
        return {}

    def score(self, batch, model):
        if model is None:
            return None
        return self.old.clone() if model is self.actor else self.ref.clone()

    def update_actor(self, batch, extras, step, mask):
        self.updates.append(extras)
        return {"actor/loss": 0.0}

    def push_weights(self):
        pass

    def step_metrics(self):
        return {}

    def trained_models(self):
        return {}

    def close(self):
        pass


class Tracker:
    start_step, history, unlogged = 0, [], None

    def __init__(self, out_dir):
        self.out_dir, self.rows = out_dir, []

    @contextmanager
    def phase(self, name):
        yield

    def log(self, step, batch, metrics):
        self.rows.append(metrics)

    def state_dict(self):
        return {}

    def close(self):
        pass


def config(algo: AlgorithmConfig, num_prompts: int = 2, **sections: object) -> Config:
    data = DataConfig(train_path="unused.jsonl", num_prompts_per_step=num_prompts)
    return Config(model=ModelConfig(hf_path="unused"), data=data, algorithm=algo, **sections)  # type: ignore[arg-type]


def run_train_loop(monkeypatch, tmp_path, algo: AlgorithmConfig, log_ratios: list[list[float]], steps: int = 1,
                   bound: float = 2.0) -> tuple[RecordingTrainer, Tracker, Batch]:
    rollout = [[-1.0, -2.0], [-0.5, -1.5]]
    batch = Batch.build([[1, 2], [1, 2]], [[3, 4], [5, 6]], rollout, [1.0, 0.0])
    old = batch.rollout_logprobs.clone()
    old[:, 1:3] += torch.tensor(log_ratios)
    trainer, tracker = RecordingTrainer(batch, old, algo.kl_coef), Tracker(tmp_path)
    cfg = config(algo, trainer=TrainerConfig(num_steps=steps),
                 rollout=RolloutConfig(logprob_diff_max=bound, num_samples_per_prompt=2, max_new_tokens=2))
    from megarl.eval.in_training import InTrainingEval

    no_eval = InTrainingEval(cfg, [], tmp_path, 0)
    monkeypatch.setattr("megarl.loop.bootstrap.setup",
                        lambda config, sets: (cfg, trainer, iter(()), str, tracker, no_eval))
    monkeypatch.setattr("megarl.checkpoint.stop_requested", lambda cfg, device: False)
    train.main(["--config", "unused.yaml"])
    return trainer, tracker, batch


def test_importance_weights_are_trainer_over_engine_probabilities(monkeypatch, tmp_path):
    algo = AlgorithmConfig(name="grpo", rollout_correction="token_tis", rollout_correction_cap=2.0)
    trainer, tracker, batch = run_train_loop(monkeypatch, tmp_path, algo, LOG_RATIOS)
    [extras] = trainer.updates
    expected = torch.zeros_like(batch.mask)
    for i, row in enumerate(LOG_RATIOS):
        for j, d in enumerate(row):
            expected[i, 1 + j] = min(math.exp(d), 2.0)  # response tokens sit at columns 1 and 2
    torch.testing.assert_close(extras["is_weights"], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(extras["old_logprobs"], trainer.old)
    [row] = tracker.rows
    assert row["rollout_correction/token_ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert row["rollout_correction/weight_mean"] == pytest.approx((1.5 + 0.8 + 2.0 + 0.6) / 4, rel=1e-5)


def test_without_a_correction_no_importance_weights_reach_the_loss(monkeypatch, tmp_path):
    trainer, _, _ = run_train_loop(monkeypatch, tmp_path, AlgorithmConfig(name="grpo"), LOG_RATIOS)
    [extras] = trainer.updates
    assert "is_weights" not in extras and set(extras) == {"old_logprobs", "advantages"}


def test_the_reference_reaches_the_loss_when_the_kl_is_not_in_the_reward(monkeypatch, tmp_path):
    """kl_in_reward: false (the 8B recipes' default): the KL term is the loss's, so its logprobs must get there."""
    algo = AlgorithmConfig(name="grpo", kl_coef=0.1, kl_estimator="k3")
    trainer, tracker, batch = run_train_loop(monkeypatch, tmp_path, algo, LOG_RATIOS)
    [extras] = trainer.updates
    torch.testing.assert_close(extras["ref_logprobs"], trainer.ref)
    # k3 of old - ref = 0.25 on every response token
    assert tracker.rows[0]["kl"] == pytest.approx(math.exp(-0.25) + 0.25 - 1, rel=1e-5)  # float32
    assert tracker.rows[0]["kl_coef"] == 0.1


def test_step_zero_stops_an_engine_that_does_not_run_the_trainers_weights(monkeypatch, tmp_path):
    far = [[0.0, 0.0], [0.0, 0.7]]  # one token 0.7 away, above a bound of 0.5
    with pytest.raises(UserError, match=r"step 0: rollout and trainer log-probabilities differ by up to 0\.700"):
        run_train_loop(monkeypatch, tmp_path, AlgorithmConfig(name="grpo"), far, bound=0.5)
    trainer, tracker, _ = run_train_loop(monkeypatch, tmp_path, AlgorithmConfig(name="grpo"), far, bound=0.8)
    assert len(trainer.updates) == 1 and tracker.rows[0]["logprob_diff_max"] == pytest.approx(0.7, rel=1e-5)


# ---- mini-batches over data-parallel ranks ----

class RecordingModel:
    replay = None

    def __init__(self) -> None:
        self.steps: list[tuple[list[list[int]], list[torch.Tensor]]] = []

    def train_step(self, seqs, rows, loss, max_tokens, micro_batch_size, where="", routing=None):
        self.steps.append(([list(s) for s in seqs], [w.clone() for w in rows["weights"]]))
        return {"lr": 0.0, "loss": 0.0}


def dp_steps(batch: Batch, mode: str, dp: int, mini_batch_size: int, epochs: int
             ) -> list[list[tuple[list[list[int]], list[torch.Tensor]]]]:
    """Per DP rank, the (sequences, weights) of each optimizer step Learner.optimize takes."""
    section = ActorConfig(mini_batch_size=mini_batch_size, num_ppo_epochs=epochs, max_tokens_per_gpu=64)
    rollout = RolloutConfig(num_samples_per_prompt=2, max_prompt_tokens=8, max_new_tokens=8)
    extras = {"advantages": torch.zeros_like(batch.mask)}
    out = []
    for rank in range(dp):
        t = object.__new__(Learner)
        t.cfg = config(AlgorithmConfig(name="grpo", loss_aggregation=mode),  # type: ignore[arg-type]
                       num_prompts=len(batch.sequences) // 2, rollout=rollout, actor=section)
        t.groups = SimpleNamespace(dp_rank=rank, dims=SimpleNamespace(dp=dp))
        model = RecordingModel()
        t.optimize(model, section, batch, extras, None, "test", 0, batch.mask)  # type: ignore[arg-type]
        out.append(model.steps)
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("dp", [2, 3])
def test_token_weights_are_normalised_over_the_mini_batch_not_per_rank(mode, dp):
    """Each DP rank trains on its share of a mini-batch; the shares' weights must add up to the aggregation of
    the whole mini-batch (DDP sums the ranks' gradients), whatever the ranks' token counts."""
    lengths = [1, 6, 2, 2, 5, 1, 3, 4]  # the ranks' shares hold very different numbers of tokens
    batch = Batch.build([[1, 2]] * 8, [[10 + i] * n for i, n in enumerate(lengths)], [[-1.0] * n for n in lengths],
                        [0.0] * 8)
    response = {tuple(s): n for s, n in zip(batch.sequences, lengths, strict=True)}
    epochs, size = 2, 4
    ranks = dp_steps(batch, mode, dp, size, epochs)
    assert len({len(steps) for steps in ranks}) == 1 and len(ranks[0]) == epochs * len(lengths) // size
    seen: defaultdict[tuple[int, ...], int] = defaultdict(int)
    for step in zip(*ranks, strict=True):  # the same optimizer step on every rank
        members = [(tuple(s), w) for seqs, weights in step for s, w in zip(seqs, weights, strict=True)]
        assert len(members) == size
        tokens = [response[s] for s, _ in members]
        for (s, w), n in zip(members, tokens, strict=True):
            seen[s] += 1
            want = {"token-mean": 1 / sum(tokens), "seq-mean-token-sum": 1 / size,
                    "seq-mean-token-mean": 1 / n / size}[mode]
            expected = torch.zeros(len(s) - 1)
            expected[len(s) - 1 - n:] = want  # prompt positions carry no weight
            torch.testing.assert_close(w.double(), expected.double(), atol=1e-7, rtol=0)
    assert set(seen.values()) == {epochs} and len(seen) == len(lengths)  # every sample once per epoch

"""Worker for test_actor_checks.py: what one actor does, checked against transformers and against itself.

torchrun --nproc-per-node 2 tests/workers/actor_checks.py OUT_DIR MODEL_DIR
One launch (the megatron import is paid once) runs three cases on a tiny Llama:
- "dp": one mini-batch of sequences of very different lengths through Learner.optimize under DP2 and under
  DP1 (TP2): the loss, entropy and grad norm of the optimizer step must not depend on how DP splits it. The
  entropy is also computed by transformers at the sampling temperature.
- "temperature": the actor's logprobs at T = 0.7 against transformers' log_softmax(logits / 0.7).
- "resume": cosine decay with warm-up over 5 steps; a checkpoint after step 2 is loaded into a fresh actor,
  which takes steps 3 and 4: each step's lr, loss and grad norm must equal the uninterrupted run's. The
  uninterrupted actor's checkpoint after step 4 is exported to HF (the mcore-to-hf command), and the exported
  model's logprobs must equal the trained actor's.
Rank 0 writes rank0.json: {case: {...}}.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl import checkpoint  # noqa: E402
from megarl.config import (  # noqa: E402
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
)
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.loop.learner import Learner  # noqa: E402
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent.parent
TEMPERATURE = 0.7


def make_batch(vocab: int, seed: int) -> Batch:
    """Prompts of 2-4 tokens; responses of 1 to 12 tokens, so that DP ranks' token counts differ a lot."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [12, 1, 2, 9, 1, 11, 3, 1]
    prompts = [torch.randint(0, vocab, (2 + i % 3,), generator=gen).tolist() for i in range(len(lengths))]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    return Batch.build(prompts, responses, [[-1.0] * n for n in lengths], torch.rand(len(lengths)).tolist())


def actor(model_dir: str, dims: ParallelDims, optim: OptimizerConfig | None, num_steps: int) -> MegatronModel:
    groups = init_model_parallel(dims)
    model_parallel_seed(0)
    return MegatronModel(load_spec(model_dir), model_dir, groups, BuildOptions(), optim, num_steps,
                         temperature=TEMPERATURE)


def score_all(model: MegatronModel, batch: Batch) -> torch.Tensor:
    """[N, T] logprobs of every sequence on every rank (the last pipeline stage holds them)."""
    rows = model.score(batch.sequences, 256, 1)
    assert rows is not None  # PP 1 here: every rank is the last stage
    return batch.stack(dict(enumerate(rows)))


def optimize(model: MegatronModel, batch: Batch, extras: dict[str, torch.Tensor], algo: AlgorithmConfig
             ) -> dict[str, float]:
    """One optimizer step on the whole batch (one mini-batch, one epoch) as the learner runs it."""
    n = len(batch.sequences)
    # A budget of 24 token slots: several micro-batches per rank.
    section = ActorConfig(mini_batch_size=n, num_ppo_epochs=1, max_tokens_per_gpu=24)
    trainer = object.__new__(Learner)
    trainer.cfg = Config(model=ModelConfig(hf_path=model.hf_dir), data=DataConfig(train_path="unused.jsonl",
                                                                                  num_prompts_per_step=n // 2),
                         rollout=RolloutConfig(num_samples_per_prompt=2, max_prompt_tokens=8, max_new_tokens=16),
                         actor=section, algorithm=algo)
    trainer.groups = model.groups

    def loss(logits: torch.Tensor, tokens: torch.Tensor, ex: dict[str, torch.Tensor]):
        return actor_loss(model.token_logprobs(logits, tokens), ex, algo, 0.1, model.token_entropy(logits))

    return trainer.optimize(model, section, batch, extras, loss, "dp case", 0, batch.mask)  # type: ignore[arg-type]


def hf_logits(model_dir: str | Path, batch: Batch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0, :-1].double() for s in batch.sequences]


def hf_logprobs(logits: list[torch.Tensor], batch: Batch, temperature: float) -> torch.Tensor:
    rows = {i: torch.log_softmax(x / temperature, dim=-1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0].float()
            for i, (x, s) in enumerate(zip(logits, batch.sequences, strict=True))}
    return batch.stack(rows)


def dp_case(model_dir: str, world: int) -> dict:
    batch = make_batch(load_spec(model_dir).vocab_size, seed=1)
    algo = AlgorithmConfig(name="grpo", clip_ratio_low=0.2, clip_ratio_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask
    ref_shift = torch.randn(batch.mask.shape, generator=gen) * 0.3
    out = {}
    for name, dims in (("dp2", ParallelDims(tp=1, pp=1, dp=world)), ("dp1", ParallelDims(tp=world, pp=1, dp=1))):
        model = actor(model_dir, dims, OptimizerConfig(lr=1e-2, clip_grad=0.0), 1)
        old = score_all(model, batch)
        extras = {"old_logprobs": old - 0.4 * advantages, "advantages": advantages,
                  "ref_logprobs": (old + ref_shift) * batch.mask}
        out[name] = optimize(model, batch, extras, algo)
        destroy_model_parallel()
    if dist.get_rank() == 0:  # the token-mean entropy of the batch at the sampling temperature, in float64
        logits = hf_logits(model_dir, batch)
        entropies = [-(torch.softmax(x / TEMPERATURE, -1) * torch.log_softmax(x / TEMPERATURE, -1)).sum(-1)
                     for x in logits]
        masked = batch.stack(dict(enumerate(e.float() for e in entropies))) * batch.mask
        out["hf_entropy"] = float(masked.sum() / batch.mask.sum())
    return out


def temperature_case(model_dir: str, world: int) -> dict:
    batch = make_batch(load_spec(model_dir).vocab_size, seed=3)
    model = actor(model_dir, ParallelDims(tp=world, pp=1, dp=1), None, 1)
    ours = score_all(model, batch)
    destroy_model_parallel()
    if dist.get_rank() != 0:
        return {}
    logits = hf_logits(model_dir, batch)
    diff = lambda t: float(((ours - hf_logprobs(logits, batch, t)).abs() * batch.mask).max())  # noqa: E731
    return {"diff": diff(TEMPERATURE), "diff_at_1": diff(1.0)}


RESUME_STEPS, SAVED_AFTER = 5, 2


def train(model: MegatronModel, step: int) -> dict[str, float]:
    batch = make_batch(model.spec.vocab_size, seed=10 + step)
    g = model.groups
    mine = list(range(g.dp_rank, len(batch.sequences), g.dims.dp))
    scale = 1.0 / float(batch.mask.sum())
    extras = {"w": [batch.mask[i, : len(batch.sequences[i]) - 1] * scale for i in mine]}

    def nll(logits: torch.Tensor, tokens: torch.Tensor, ex: dict):
        return -(model.token_logprobs(logits, tokens) * ex["w"]).sum(), {}

    metrics = model.train_step([batch.sequences[i] for i in mine], extras, nll, 32)
    return {k: metrics[k] for k in ("lr", "loss", "grad_norm")}


def resume_case(model_dir: str, world: int, out_dir: Path) -> dict:
    optim = OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_schedule="cosine", num_warmup_steps=2, clip_grad=1.0)
    dims = ParallelDims(tp=1, pp=1, dp=world)
    model = actor(model_dir, dims, optim, RESUME_STEPS)
    full = []
    for step in range(RESUME_STEPS):
        full.append(train(model, step))
        if step == SAVED_AFTER:
            saved = checkpoint.save(str(out_dir / "ckpt"), step, {"actor": model}, {}, keep_last=1)
    last = checkpoint.save(str(out_dir / "last"), RESUME_STEPS - 1, {"actor": model}, {}, keep_last=1)
    batch = make_batch(model.spec.vocab_size, seed=20)
    trained = score_all(model, batch)
    destroy_model_parallel()
    model = actor(model_dir, dims, optim, RESUME_STEPS)
    checkpoint.load(saved, {"actor": model})
    resumed = [train(model, step) for step in range(SAVED_AFTER + 1, RESUME_STEPS)]
    destroy_model_parallel()
    if dist.get_rank() != 0:
        return {}
    hf = out_dir / "exported"
    proc = subprocess.run([sys.executable, "-m", "megarl.convert", "mcore-to-hf", "--ckpt", str(last / "actor"),
                           "--out", str(hf)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits = hf_logits(hf, batch)
    initial = hf_logits(model_dir, batch)
    mask = batch.mask
    return {"full": full, "resumed": resumed,
            "export_diff": float(((trained - hf_logprobs(logits, batch, TEMPERATURE)).abs() * mask).max()),
            "trained_moved": float(((trained - hf_logprobs(initial, batch, TEMPERATURE)).abs() * mask).max())}


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    world = dist.get_world_size()
    rows = {"dp": dp_case(model_dir, world), "temperature": temperature_case(model_dir, world),
            "resume": resume_case(model_dir, world, out_dir)}
    if dist.get_rank() == 0:
        (out_dir / "rank0.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Worker for test_checkpoint.py: resuming in another layout continues the run as if uninterrupted.

torchrun --nproc-per-node 4 tests/workers/checkpoint_layout.py OUT_DIR MODEL_DIR [MODEL_DIR ...]
For each model (in OUT_DIR/<its directory's name>): an actor and a critic train 2 steps in layout A
(TP2 x DP2, distributed optimizer) and are saved; A then takes a third step. Each resumed layout (A
itself, other TP/PP/DP, without the distributed optimizer) loads the checkpoint and takes the same
third step: its loss, grad norm, learning rate and updated weights must equal A's. Rank 0 writes one
row per layout. Last, loading the last model's checkpoint with a config.json that names another
architecture must stop every rank with a UserError (exit code 2). An MoE model runs MOE_LAYOUTS
instead: A splits its experts over 2 expert-parallel ranks.
"""

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl import checkpoint  # noqa: E402
from megarl.config import OptimizerConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.mapping import param_rules  # noqa: E402
from megarl.models.mcore_ckpt import read_meta, reshard, saved_shards  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402
from megarl.run.command import run_main  # noqa: E402

# (TP, PP, DP, virtual pipeline, distributed optimizer, expert parallel); the first is layout A.
LAYOUTS = [(2, 1, 2, None, True, 1), (1, 2, 2, None, True, 1), (1, 1, 4, None, False, 1), (2, 2, 1, None, True, 1),
           (1, 2, 2, 2, True, 1)]
MOE_LAYOUTS = [(1, 1, 4, None, True, 2), (1, 1, 4, None, True, 4), (1, 1, 4, None, False, 2),
               (2, 1, 2, None, True, 1), (1, 2, 2, None, False, 2)]
NUM_STEPS = 4


def batch(step: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(4, 13, (8,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def build(model_dir: str, layout: tuple[int, int, int, int | None, bool, int]) -> dict[str, MegatronModel]:
    tp, pp, dp, vpp, distributed, ep = layout
    groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=dp, vpp=vpp, ep=ep))
    model_parallel_seed(0)
    spec = load_spec(model_dir)
    sp = spec.is_moe and tp > 1  # Megatron's MoE layers train under TP only with sequence parallelism
    # Warm-up, cosine decay and weight decay, so the schedule and every optimizer field matter. Some
    # gradients are pure rounding noise (the key bias: softmax ignores a shift; the critic body while its
    # value head is near zero), and Adam scales noise below its epsilon up to full-size steps that differ
    # between any two layouts, resumed or not; epsilon 1e-5 keeps those steps below the tolerance.
    optim = OptimizerConfig(lr=1e-2, min_lr=1e-3, lr_schedule="cosine", num_warmup_steps=1, weight_decay=0.1,
                            adam_eps=1e-5, clip_grad=1.0, use_distributed_optimizer=distributed)
    return {role: MegatronModel(spec, model_dir, groups, BuildOptions(critic=role == "critic", sequence_parallel=sp),
                                optim, NUM_STEPS) for role in ("actor", "critic")}


def train_step(models: dict[str, MegatronModel], step: int) -> dict[str, float]:
    actor, critic = models["actor"], models["critic"]
    g = actor.groups
    seqs = batch(step, actor.spec.vocab_size)
    scale = 1.0 / sum(len(s) - 1 for s in seqs)  # weights of the global batch: DP shares add up
    mine = seqs[g.dp_rank::g.dims.dp]
    extras = {"w": [torch.full((len(s) - 1,), scale) for s in mine],
              "target": [torch.linspace(-1, 1, len(s) - 1) for s in mine]}

    def nll(logits: torch.Tensor, tokens: torch.Tensor, ex: dict) -> tuple[torch.Tensor, dict]:
        return -(actor.token_logprobs(logits, tokens) * ex["w"]).sum(), {}

    def value_loss(values: torch.Tensor, tokens: torch.Tensor, ex: dict) -> tuple[torch.Tensor, dict]:
        return ((values[:, :-1, 0].float() - ex["target"]) ** 2 * ex["w"]).sum(), {}

    a = actor.train_step(mine, extras, nll, 24)  # several micro-batches per step
    c = critic.train_step(mine, extras, value_loss, 24)
    keys = ("loss", "grad_norm", "lr")
    return {f"actor/{k}": a[k] for k in keys} | {f"critic/{k}": c[k] for k in keys}


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the saved actor and critic, resharded to TP1."""
    out = {}
    for role in ("actor", "critic"):
        meta, spec, critic = read_meta(ckpt / role), load_spec(ckpt / role), role == "critic"
        names = [r.mcore for r in param_rules(spec, include_output=not critic)] + ["output_layer.weight"] * critic
        padded = spec.padded_vocab_size(1, meta["vocab_pad_multiple"])
        shards = reshard(spec, saved_shards(ckpt / role), meta, names, 0, 1, padded, critic)
        out |= {f"{role}/{name}": t for name, t in shards}
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per role, the largest elementwise difference."""
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return {f"{role}/weights": max((a[k] - b[k]).abs().max().item() for k in a if k.startswith(role))
            for role in ("actor", "critic")}


def resume_in_each_layout(out_dir: Path, model_dir: str) -> tuple[Path, dict[str, MegatronModel]]:
    """Rank 0 writes out_dir/rank0.json; the checkpoint of layout A and the last layout's models, still built."""
    out_dir.mkdir(exist_ok=True)
    rank = dist.get_rank()
    layouts = MOE_LAYOUTS if load_spec(model_dir).is_moe else LAYOUTS
    models = build(model_dir, layouts[0])
    for step in range(2):
        train_step(models, step)
    started = time.perf_counter()
    saved = checkpoint.save(str(out_dir / "a"), 1, models, {"loader": "data position"}, keep_last=1)
    save_s = time.perf_counter() - started
    reference = train_step(models, 2)
    checkpoint.save(str(out_dir / "a_next"), 2, models, {}, keep_last=1)
    destroy_model_parallel()
    if rank == 0:
        expected = weights(out_dir / "a_next" / "step_000002")
        size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
        rows: list[dict] = [{"save_s": save_s, "size": size, "moved": max_diff(weights(saved), expected)}]
    for i, layout in enumerate(layouts):
        models = build(model_dir, layout)
        started = time.perf_counter()
        state = checkpoint.load(saved, models)
        load_s = time.perf_counter() - started
        metrics = train_step(models, 2)
        after = checkpoint.save(str(out_dir / f"b{i}"), 2, models, {}, keep_last=1)
        if rank == 0:
            rows.append({"layout": list(layout), "loader": state["loader"], "load_s": load_s,
                         **max_diff(weights(after), expected),
                         **{k: abs(metrics[k] - reference[k]) for k in reference}})
        if i < len(layouts) - 1:
            destroy_model_parallel()
    if rank == 0:
        (out_dir / "rank0.json").write_text(json.dumps(rows))
    return saved, models


def main() -> None:
    out_dir, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    init_distributed(platform)
    for i, model_dir in enumerate(model_dirs):  # one launch for all: torchrun's start-up and imports paid once
        if i:
            destroy_model_parallel()
        saved, models = resume_in_each_layout(out_dir / Path(model_dir).name, model_dir)
    bad = out_dir / "bad"
    if dist.get_rank() == 0:
        shutil.copytree(saved, bad)
        config = json.loads((bad / "actor" / "config.json").read_text())
        (bad / "actor" / "config.json").write_text(json.dumps(config | {"intermediate_size": 32}))
    dist.barrier()
    checkpoint.load(bad, models)


if __name__ == "__main__":
    run_main(main)

"""Multi-rank worker for test_lora_training.py: a LoRA actor (actor.lora) in three layouts, one launch.

torchrun --nproc-per-node 2 tests/workers/lora_actor.py OUT_DIR MODEL_DIR
In each layout (DP2 with the distributed optimizer sharding the adapters' state; TP2; PP2) it builds the base model
(scoring only) and the LoRA actor (megarl.lora.training) from the same HF weights, in float32, and reports: the
actor's logprobs before training against the base model's (B = 0); what DDP and the optimizer hold (adapters only);
after one train_step, whether the base weights are bit for bit the same and the adapters moved; the reference (the
actor with its adapters off, lora_training.BaseModel) against the base model; the hand-over tensors (named_params
after refresh_merged) against W + s B A; and actors resumed from a checkpoint of this layout and of the one before.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402

from megarl import checkpoint  # noqa: E402
from megarl.config import OptimizerConfig  # noqa: E402
from megarl.config.lora import LoraConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.lora import training as lora_training  # noqa: E402
from megarl.memory.offload import PARTS, ModelResidency  # noqa: E402
from megarl.models.gpt import BuildOptions, canonical_params  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["qkv", "o", "fc1", "fc2"])


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    world = dist.get_world_size()
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (7, 9, 5, 12)]
    rows, previous = [], None
    for tp, pp in ((1, 1), (world, 1), (1, world)):  # each resumes the one before's checkpoint too
        rows.append(run(spec, model_dir, out_dir, seqs, gen, ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)),
                        previous))
        previous = out_dir / f"ckpt_tp{tp}_pp{pp}" / "step_000001"
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def same(a, b) -> bool:
    """Two scorings (None off the last pipeline stage) bit for bit equal."""
    return (a is None) == (b is None) and (a is None or all(torch.equal(x, y) for x, y in zip(a, b, strict=True)))


def run(spec, model_dir, out_dir, seqs, gen, dims, previous) -> dict:
    groups = init_model_parallel(dims)
    model_parallel_seed(0)
    opts = BuildOptions(dtype=torch.float32)
    base = MegatronModel(spec, model_dir, groups, opts)
    base_lp = base.score(seqs, 64)
    actor = MegatronModel(spec, model_dir, groups, opts,
                          OptimizerConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=True), num_steps=2,
                          adapters=lora_training.LoraAdapters(LORA, seed=3))
    row: dict = {"rank": dist.get_rank(), "tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "last": base_lp is not None}
    trainable = [p for c in actor.chunks for p in c.parameters() if p.requires_grad]
    row["trainable"] = sum(p.numel() for p in trainable)
    row["expected_adapters"] = lora_training.adapter_params_per_rank(spec, LORA, dims.tp, dims.pp)
    row["ddp_grad_numel"] = sum(b.grad_data.numel() for m in actor.models for b in m.buffers)
    row["optimizer_numel"] = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    row["merged_numel"] = sum(a.merged.numel() for _, a in lora_training.adapted(actor.chunks))
    row["expected_merged"] = lora_training.merged_params_per_rank(spec, LORA, dims.tp, dims.pp)
    row["zero_b_exact"] = same(actor.score(seqs, 64), base_lp)
    weights_before = {n: p.detach().clone() for n, p in canonical_params(actor.chunks, spec, groups).items()}
    adapters_before = [p.detach().clone() for p in trainable]
    handover = actor.named_params()
    addresses = {n: t.data_ptr() for n, t in handover.items()}

    def loss(logits, tokens, ex):
        logp = actor.token_logprobs(logits, tokens)
        return -(logp * ex["advantages"] * ex["weights"]).sum(), {}

    adv = [torch.randn(len(s) - 1, generator=gen) for s in seqs]
    weights = [torch.full((len(s) - 1,), 1.0 / sum(len(t) - 1 for t in seqs)) for s in seqs]
    metrics = actor.train_step(seqs, {"advantages": adv, "weights": weights}, loss, 64)
    row["grad_norm"] = metrics["grad_norm"]
    after = canonical_params(actor.chunks, spec, groups)
    row["base_identical"] = all(torch.equal(weights_before[n], p) for n, p in after.items())
    moved = {id(p): float((p - q).abs().max()) for p, q in zip(trainable, adapters_before, strict=True)}
    factors = [(m.A, m.B) for _, m in lora_training.adapted(actor.chunks)]
    # From B = 0 the first step's gradient reaches B only (dL/dA = s B^T dL/dy = 0): A moves from the second on.
    row["b_moved"] = min(moved[id(b)] for _, b in factors)
    row["a_moved"] = max(moved[id(a)] for a, _ in factors)
    trained_lp = actor.score(seqs, 64)
    row["trained_moved"] = (max(float((a - b).abs().max()) for a, b in zip(trained_lp, base_lp, strict=True))
                            if base_lp is not None else None)
    reference = lora_training.BaseModel(actor)
    row["reference_exact"] = same(reference.score(seqs, 64), base_lp)
    row["adapters_back_on"] = same(actor.score(seqs, 64), trained_lp)
    # The hand-over: the same tensors as at start (the resharder keeps them), W + s B A after refresh_merged.
    actor.refresh_merged()
    handover = actor.named_params()
    row["same_addresses"] = {n: t.data_ptr() for n, t in handover.items()} == addresses
    canonical = {id(p): n for n, p in after.items()}  # global layer numbers under PP
    adapted = {canonical[id(m.weight)]: (m.weight, a) for m, a in lora_training.adapted(actor.chunks)}
    diffs, names = [], []
    for name, (w, a) in adapted.items():
        expected = w + a.scaling * a.B @ a.A
        diffs.append(float((handover[name] - expected).abs().max()))
        names.append(name)
    row["merged_names"], row["expected_names"] = len(names), 4 * spec.num_layers // dims.pp
    row["merged_diff"] = max(diffs)
    row["merged_moved"] = max(float((handover[n] - after[n]).abs().max()) for n in names)
    row["others_are_weights"] = all(handover[n] is after[n].data or torch.equal(handover[n], after[n])
                                    for n in after if n not in names)
    # The merged buffers are module buffers: they leave the device and come back with the weights.
    snapshot = {n: handover[n].clone() for n in names}
    residency = ModelResidency(actor)
    residency.offload(PARTS)
    residency.onload(PARTS)
    row["merged_after_offload"] = max(float((handover[n] - snapshot[n]).abs().max()) for n in names)
    # A checkpoint holds the adapters and their optimizer state: a fresh actor (other A) resumed from it takes the
    # same second step as the actor that saved it.
    saved = checkpoint.save(str(out_dir / f"ckpt_tp{dims.tp}_pp{dims.pp}"), 1, {"actor": actor}, {}, keep_last=1)
    resumed = MegatronModel(spec, model_dir, groups, opts,
                            OptimizerConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=True), num_steps=2,
                            adapters=lora_training.LoraAdapters(LORA, seed=4))
    checkpoint.load(saved, {"actor": resumed})
    row["resumed_adapters"] = all(torch.equal(p, q) for p, q in zip(
        resumed.adapter_params().values(), actor.adapter_params().values(), strict=True))
    if previous is not None:  # the layout before's checkpoint, resumed in this one and saved again as it holds it
        cross = MegatronModel(spec, model_dir, groups, opts,
                              OptimizerConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=True), num_steps=2,
                              adapters=lora_training.LoraAdapters(LORA, seed=5))
        checkpoint.load(previous, {"actor": cross})
        checkpoint.save(str(out_dir / f"cross_tp{dims.tp}_pp{dims.pp}"), 1, {"actor": cross}, {}, keep_last=1)
    second = [m.train_step(seqs, {"advantages": adv, "weights": weights}, loss, 64) for m in (actor, resumed)]
    row["resumed_step"] = [s["grad_norm"] for s in second]
    row["resumed_exact"] = same(actor.score(seqs, 64), resumed.score(seqs, 64))
    if dims.tp > 1:  # column layers draw A's input mask from the RNG seeded alike over TP, row layers per rank
        row["dropout"] = dropout_checks(spec, model_dir, groups, seqs, adv, weights)
    destroy_model_parallel()
    return row


def dropout_checks(spec, model_dir, groups, seqs, adv, weights) -> dict:
    """actor.lora.dropout: active in the update (its first step moves B unlike the same actor's without dropout),
    never in scoring, and replayed by activation recompute (the same step with and without it)."""
    def actor(dropout, recompute=False, seed=3):
        opts = BuildOptions(dtype=torch.float32, recompute_activations=recompute)
        return MegatronModel(spec, model_dir, groups, opts, OptimizerConfig(lr=1e-2, clip_grad=0.0), num_steps=2,
                             adapters=lora_training.LoraAdapters(LoraConfig(rank=4, alpha=8.0, dropout=dropout),
                                                                 seed=seed))

    def step(model):
        model_parallel_seed(123)  # the same masks for the same draws

        def loss(logits, tokens, ex):
            logp = model.token_logprobs(logits, tokens)
            return -(logp * ex["advantages"] * ex["weights"]).sum(), {}

        return model.train_step(seqs, {"advantages": adv, "weights": weights}, loss, 64)["grad_norm"]

    models = [actor(0.0), actor(0.5), actor(0.5, recompute=True)]
    norms = [step(m) for m in models]
    b = [[p.detach().clone() for n, p in m.adapter_params().items() if n.endswith(".B")] for m in models]
    out = {"grad_norms": norms,
           "b_vs_no_dropout": max(float((x - y).abs().max()) for x, y in zip(b[1], b[0], strict=True)),
           "b_vs_recompute": max(float((x - y).abs().max()) for x, y in zip(b[1], b[2], strict=True))}
    scores = models[1].score(seqs, 64)  # B moved: a mask in scoring would change these
    for _, adapter in lora_training.adapted(models[1].chunks):
        adapter.dropout = 0.0
    out["score_without_dropout"] = same(scores, models[1].score(seqs, 64))
    return out


if __name__ == "__main__":
    main()

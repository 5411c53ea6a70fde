"""Multi-rank worker for test_routing.py: routing replay against transformers with the same experts forced.

torchrun --nproc-per-node 4 tests/workers/routing.py OUT_DIR MODEL_DIR
Every sequence gets random expert choices (what an engine would return); transformers' routers are made to
pick them, and megarl's actor, replaying them, must give transformers' log-probabilities in every layout
(TP with sequence parallelism, PP, VPP, EP; rows packed). Replaying transformers' own choices must give its
unforced result with no disagreement. A training step with replay must not depend on the layout, activation
recompute under pipelining included (the backward pass re-runs each micro-batch's routing).
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megarl.algos.losses import token_weights  # noqa: E402
from megarl.config import AlgorithmConfig, OptimizerConfig  # noqa: E402
from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.loop.rl_step import Batch, actor_loss  # noqa: E402
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.routing import routing_dtype  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.models.trainable import MegatronModel  # noqa: E402

# (tp, pp, vpp, ep, sequence_parallel, packing): "thd" runs the rows end to end in Megatron's packed format
SCORE_LAYOUTS = [(1, 1, None, 1, False, "auto"), (2, 1, None, 1, True, "auto"), (1, 2, None, 1, False, "auto"),
                 (1, 2, 2, 1, False, "auto"), (1, 1, None, 2, False, "auto"), (2, 1, None, 2, True, "auto"),
                 (2, 1, None, 2, True, "thd")]
# (tp, pp, vpp, ep, sequence_parallel, recompute, packing)
TRAIN_LAYOUTS = [(1, 1, None, 1, False, False, "auto"), (1, 2, None, 1, False, True, "auto"),
                 (2, 1, None, 1, True, True, "auto"), (1, 1, None, 2, False, False, "auto"),
                 (1, 2, None, 1, False, True, "thd")]


def hf_logprobs(hf, sequences, forced):
    """transformers' per-token logprobs, each layer's router made to pick ``forced[i]`` ([len-1, L, k], or None:
    its own choice), the sequence's last token routed by itself; also the choices it made by itself."""
    own_choices = []
    current: dict[int, torch.Tensor | None] = {}

    def router(gate, layer):
        def forward(hidden):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            own_choices[-1][layer] = own
            target = current[layer]
            index = own if target is None else torch.cat([target, own[target.shape[0]:]])
            top = probs.gather(1, index)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), index
        return forward

    for layer, block in enumerate(hf.model.layers):
        block.mlp.gate.forward = router(block.mlp.gate, layer)
    out = []
    with torch.no_grad():
        for i, seq in enumerate(sequences):
            own_choices.append({})
            for layer in range(len(hf.model.layers)):
                current[layer] = None if forced is None else forced[i][:, layer]
            logits = hf(torch.tensor([seq])).logits[0].float()
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
            out.append(lp)
    own = [torch.stack([c[layer][:-1] for layer in sorted(c)], dim=1) for c in own_choices]
    return out, own


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    world = dist.get_world_size()
    spec = load_spec(model_dir)
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 5, 12, 7, 3, 10, 6, 8]
    sequences = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    k, num_layers, num_experts = spec.num_experts_per_tok, spec.num_layers, spec.num_experts
    forced = [torch.rand(n - 1, num_layers, num_experts, generator=gen).argsort(-1)[..., :k] for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref_forced, _ = hf_logprobs(hf, sequences, forced)
    ref_own, own = hf_logprobs(hf, sequences, None)
    as_engine = [[f.numpy().astype(routing_dtype(num_experts)) for f in choices] for choices in (forced, own)]
    results = []
    for tp, pp, vpp, ep, sp, packing in SCORE_LAYOUTS:
        groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp), vpp=vpp, ep=ep))
        model_parallel_seed(0)
        actor = MegatronModel(spec, model_dir, groups, BuildOptions(sequence_parallel=sp, packing=packing),
                              OptimizerConfig(lr=1e-2), routing_replay=True)
        row = {"kind": "score", "tp": tp, "pp": pp, "vpp": vpp, "ep": ep, "packing": packing}
        for name, routing, ref in (("forced", as_engine[0], ref_forced), ("own", as_engine[1], ref_own)):
            # Each DP rank scores every sequence (so every rank compares); rows packed up to 24 token slots.
            got = actor.score(sequences, 24, routing=routing)
            disagreement = actor.routing_disagreement()["routing/disagreement"]
            if got is not None:
                row[name] = max((g - r).abs().max().item() for g, r in zip(got, ref, strict=True))
            row[f"{name}_disagreement"] = disagreement
        row["forced_vs_own"] = max((a - b).abs().max().item() for a, b in zip(ref_forced, ref_own, strict=True))
        if groups.is_last_stage and groups.tp_rank == 0:
            results.append(row)
        destroy_model_parallel()

    batch = Batch.build([s[:2] for s in sequences], [s[2:] for s in sequences],
                        [[-1.0] * (n - 2) for n in lengths], [0.0] * len(sequences), as_engine[0])
    algo = AlgorithmConfig(name="grpo")
    advantages = torch.randn(batch.mask.shape, generator=gen) * batch.mask
    weights = token_weights(batch.mask, algo.loss_aggregation)
    for tp, pp, vpp, ep, sp, recompute, packing in TRAIN_LAYOUTS:
        dims = ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp), vpp=vpp, ep=ep)
        groups = init_model_parallel(dims)
        model_parallel_seed(0)
        actor = MegatronModel(spec, model_dir, groups,
                              BuildOptions(sequence_parallel=sp, recompute_activations=recompute, packing=packing),
                              OptimizerConfig(lr=1e-2, clip_grad=0.0), routing_replay=True)
        old = torch.stack([torch.nn.functional.pad(r, (0, batch.mask.shape[1] - r.shape[0])) for r in ref_forced])
        extras = {"old_logprobs": old - 0.5 * advantages, "advantages": advantages, "weights": weights}
        mine = list(range(groups.dp_rank, len(sequences), dims.dp))
        rows = {name: [batch.rows(v)[i] for i in mine] for name, v in extras.items()}

        def loss(logits, tokens, ex, a=actor):
            return actor_loss(a.token_logprobs(logits, tokens), ex, algo, 0.0, None)

        # 20 token slots: several micro-batches per rank, so pipelined forwards run ahead of their backwards.
        metrics = actor.train_step([sequences[i] for i in mine], rows, loss, 20,
                                   routing=[as_engine[0][i] for i in mine])
        after = actor.score(sequences, 24, routing=as_engine[0])
        if after is not None and groups.tp_rank == 0 and groups.dp_rank == 0:
            results.append({"kind": "train", "tp": tp, "pp": pp, "ep": ep, "recompute": recompute, "packing": packing,
                            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                            "logprobs_after": torch.cat(after).tolist()})
        destroy_model_parallel()
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

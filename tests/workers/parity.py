"""Multi-rank worker for test_parity.py: megarl logits, logprobs and critic values vs HF transformers.

torchrun --nproc-per-node 4 tests/workers/parity.py OUT_DIR MODEL_DIR...
Runs every layout in one launch (megatron's import is paid once) and writes, per comparing rank,
OUT_DIR/rank{r}.json with the max abs differences it measured.
"""

import json
import os
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.models.forward import forward_only, micro_batches, sequence_logprobs  # noqa: E402
from megarl.models.gpt import BuildOptions, build_model, layer_implementation, load_hf_weights  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402

LAYOUTS = [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
# MoE models also with experts split over expert-parallel ranks: (tp, pp, vpp, ep).
MOE_LAYOUTS = [(1, 1, None, 2), (1, 1, None, 4), (2, 1, None, 2), (1, 2, None, 2)]
DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}[os.environ.get("PARITY_DTYPE", "float32")]
TE = os.environ.get("PARITY_TE") == "1"  # Transformer Engine's layer spec (GPU with TE installed)


def main() -> None:
    out_dir, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    init_distributed(platform)
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    results = []
    for model_dir in model_dirs:
        spec = load_spec(model_dir)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE).to(platform.device).eval()
        lengths = [9, 5, 12]
        sequences = [torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        head = torch.randn(1, spec.hidden_size, generator=gen)
        with torch.no_grad():
            inputs = [torch.tensor([s], device=platform.device) for s in sequences]
            ref_logits = [hf(t).logits[0].float().cpu() for t in inputs]
            ref_values = [(hf.model(t).last_hidden_state[0].float().cpu() @ head[0]) for t in inputs]
        for tp, pp, vpp, ep in [(*layout, 1) for layout in LAYOUTS] + (MOE_LAYOUTS if spec.is_moe else []):
            if world % (tp * pp) or (world // (tp * pp)) % ep:
                continue
            groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp), vpp=vpp, ep=ep))
            model_parallel_seed(1)
            opts = BuildOptions(dtype=DTYPE, transformer_engine=TE)
            chunks = build_model(spec, groups, opts)
            entry = {"model": Path(model_dir).name, "tp": tp, "pp": pp, "vpp": vpp, "ep": ep,
                     "layers": layer_implementation(chunks)}
            load_hf_weights(chunks, spec, model_dir, groups, opts)
            for chunk in chunks:
                chunk.eval()  # as megarl.score does (MoE under TP refuses training mode without sequence parallel)

            def gather_logits(tokens: torch.Tensor, logits: torch.Tensor, g=groups, v=spec.vocab_size) -> torch.Tensor:
                parts = [torch.empty_like(logits) for _ in range(g.dims.tp)]
                dist.all_gather(parts, logits.contiguous(), group=g.tp_group)
                return torch.cat(parts, dim=-1)[..., :v].float().cpu()

            batches = micro_batches(sequences, micro_batch_size=2)
            # The chunked head (megarl.score --logprob-chunk-tokens) first: the output layer gives logits again after.
            chunked = sequence_logprobs(chunks, spec, groups, sequences, micro_batch_size=2, chunk_tokens=3)
            logits = forward_only(chunks, groups, batches, gather_logits)
            logprobs = sequence_logprobs(chunks, spec, groups, sequences, micro_batch_size=2)

            critic_opts = BuildOptions(critic=True, dtype=DTYPE, transformer_engine=TE)
            critic = build_model(spec, groups, critic_opts)
            load_hf_weights(critic, spec, model_dir, groups, critic_opts)
            for chunk in critic:
                chunk.eval()
            if groups.is_last_stage:
                with torch.no_grad():
                    critic[-1].output_layer.weight.copy_(head.to(DTYPE))
            values = forward_only(critic, groups, batches, lambda tokens, v: v[..., 0].float().cpu())

            if logits is not None and logprobs is not None and values is not None and groups.tp_rank == 0:
                rows = torch.cat(logits)
                value_rows = torch.cat(values)
                d_logit = d_lp = d_chunked = d_val = 0.0
                for i, seq in enumerate(sequences):
                    n = len(seq)
                    ref = ref_logits[i]
                    d_logit = max(d_logit, (rows[i, :n] - ref).abs().max().item())
                    ref_lp = torch.log_softmax(ref, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
                    d_lp = max(d_lp, (torch.tensor(logprobs[i]) - ref_lp).abs().max().item())
                    assert chunked is not None
                    d_chunked = max(d_chunked, (torch.tensor(chunked[i]) - ref_lp).abs().max().item())
                    d_val = max(d_val, (value_rows[i, :n] - ref_values[i]).abs().max().item())
                results.append(entry | {"logits": d_logit, "logprobs": d_lp, "chunked_logprobs": d_chunked,
                                        "values": d_val})
            destroy_model_parallel()
    if results:
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Multi-rank worker for test_reward_model.py: megarl's reward model scores vs transformers' sequence classification.

torchrun --nproc-per-node 4 tests/workers/reward_model.py OUT_DIR MODEL_DIR...
Runs every layout in one launch (megatron's import is paid once) and writes, per rank holding scores,
OUT_DIR/rank{r}.json with the largest difference to transformers' logits it measured.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

from megarl.distributed.parallel import (  # noqa: E402
    ParallelDims,
    destroy_model_parallel,
    init_distributed,
    init_model_parallel,
    model_parallel_seed,
)
from megarl.models.gpt import BuildOptions  # noqa: E402
from megarl.models.reward_model import RewardModel, load_reward_spec  # noqa: E402

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True)]  # (tp, pp, sequence parallel)


def main() -> None:
    out_dir, model_dirs = Path(sys.argv[1]), sys.argv[2:]
    init_distributed(platform)
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    results = []
    for model_dir in model_dirs:
        spec = load_reward_spec(model_dir)
        pad = spec.hf_config["pad_token_id"]
        hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
        # Token ids other than the pad token, then one sequence ending in pad tokens: transformers reads it at its
        # last token before them, as right padding.
        sequences = [(torch.randint(1, spec.vocab_size, (n,), generator=gen)).tolist() for n in (9, 5, 12, 1, 7)]
        sequences.append(sequences[0][:6] + [pad, pad])
        width = max(len(s) for s in sequences)
        with torch.no_grad():  # padded batches as a HF user scores them: right-padded, then left-padded
            right = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
            left = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
            ref_right = hf(right).logits[:, 0]
            ref_left = hf(left, attention_mask=(left != pad).long()).logits[:, 0]  # as a HF user passes it
        for tp, pp, sp in LAYOUTS:
            if world % (tp * pp):
                continue
            groups = init_model_parallel(ParallelDims(tp=tp, pp=pp, dp=world // (tp * pp)))
            model_parallel_seed(1)
            rm = RewardModel(spec, model_dir, groups, BuildOptions(dtype=torch.float32, sequence_parallel=sp))
            for mbs, budget in ((2, None), (1, None), (1, 64)):  # padded micro-batches, and packed rows
                scores = rm.score(sequences, max_tokens=budget, micro_batch_size=mbs)
                if scores is not None and groups.tp_rank == 0:
                    got = torch.tensor(scores)
                    results.append({"model": Path(model_dir).name, "tp": tp, "pp": pp, "sp": sp, "mbs": mbs,
                                    "budget": budget,
                                    "right": float((got - ref_right).abs().max()),
                                    "left": float((got - ref_left).abs().max()),
                                    "spread": float(ref_right.std())})
            destroy_model_parallel()
    if results:
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

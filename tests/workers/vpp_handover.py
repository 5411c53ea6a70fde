"""Worker for test_pipeline_placement.py: a Megatron model of interleaved pipeline chunks (PP 2, VPP 2) hands over.

torchrun --nproc-per-node 2 tests/workers/vpp_handover.py OUT_DIR MODEL_DIR
Builds this rank's GPTModel chunks, loads the HF weights and checks, by the global layer number megatron-core gave
each layer (TransformerLayer.layer_number), that every layer holds its own HF layer's weights and is the parameter
megarl names after that layer (canonical_params, what the hand-over reads). Then refits into engine tensors
(filled with NaN so an unwritten byte shows) for rollout TP 1 and 2, compared with the engine's own slices of HF.
"""

import json
import sys
from pathlib import Path

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
from engine_reference import load_hf, reference_engine  # noqa: E402

from megarl.distributed.parallel import ParallelDims, init_distributed, init_model_parallel  # noqa: E402
from megarl.models.gpt import BuildOptions, build_model, canonical_params, load_hf_weights, unwrap  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.reshard.executor import Resharder, engine_tensor_allocations  # noqa: E402
from megarl.reshard.planner import make_plan  # noqa: E402


def main() -> None:
    out_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_distributed(platform)
    rank = dist.get_rank()
    spec, hf = load_spec(model_dir), load_hf(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    dims = ParallelDims(tp=1, pp=2, dp=1, vpp=2)
    groups = init_model_parallel(dims)
    opts = BuildOptions()
    chunks = build_model(spec, groups, opts)
    load_hf_weights(chunks, spec, model_dir, groups, opts)
    params = canonical_params(chunks, spec, groups)
    layers, named_alike, loaded = [], True, True
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            i = layer.layer_number - 1
            layers.append(i)
            norm = layer.input_layernorm.weight
            named_alike &= params[f"decoder.layers.{i}.input_layernorm.weight"] is norm
            loaded &= torch.equal(norm, hf[f"model.layers.{i}.input_layernorm.weight"])
            loaded &= torch.equal(layer.mlp.linear_fc2.weight, hf[f"model.layers.{i}.mlp.down_proj.weight"])
    src = {n: p.data for n, p in params.items()}
    exact = {}
    for r in (1, 2):
        plan = make_plan(spec, dims, r, gpus_per_node=2, element_size=4, bucket_bytes=48 * 1024)
        dst = engine_tensor_allocations(plan, rank, torch.float32, torch.device("cpu"))
        for t in dst.values():
            t.fill_(float("nan"))
        Resharder(plan, rank, src, dst).refit()
        ref = reference_engine(hf, cfg, r, plan.engine_rank(rank))
        exact[r] = sorted(ref) == sorted(dst) and all(torch.equal(dst[n], ref[n]) for n in ref)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "layers": layers, "named_alike": named_alike, "loaded": loaded, "exact": exact}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Engine tensors the way an engine's weight loader slices full HF tensors, and a trainer rank's Megatron shards
read from HF through the mapping: the references of the resharding workers, and their check of a hand-over to
engines on GPUs of their own, without megatron-core (engine workers outside the trainer's world import only this)."""

import math
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megarl.distributed.parallel import ParallelDims
from megarl.models.mapping import param_rules, pipeline_stage, to_mcore_shard
from megarl.reshard.executor import Resharder, engine_tensor_allocations, padding_rows
from megarl.reshard.handover import HandoverState, apply_message
from megarl.reshard.planner import Plan
from megarl.reshard.receiver import EngineReceiver
from megarl.reshard.verify import tensor_checksum


def load_hf(model_dir: str) -> dict:
    """Every tensor of an HF checkpoint's safetensors files, by name."""
    hf = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        hf |= load_file(f)
    return hf


def reference_engine(hf: dict, cfg: dict, R: int, r: int) -> dict:
    """Engine rank r's tensors the way an engine's weight loader slices full HF tensors."""
    V, H, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or H // nh
    vp = math.ceil(V / 64) * 64
    rows = vp // R

    def vocab(w):
        full = torch.zeros(vp, H, dtype=w.dtype)
        full[:V] = w
        return full[r * rows:(r + 1) * rows]

    out = {"model.embed_tokens.weight": vocab(hf["model.embed_tokens.weight"]),
           "model.norm.weight": hf["model.norm.weight"]}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = vocab(hf["lm_head.weight"])
    q_heads = slice(r * nh // R, (r + 1) * nh // R)
    kv_first = r * nkv // R
    kv_heads = slice(kv_first, kv_first + max(1, nkv // R))
    for i in range(L):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" not in hf:
                continue
            q = hf[p + f"self_attn.q_proj.{kind}"].unflatten(0, (nh, d))[q_heads].flatten(0, 1)
            k = hf[p + f"self_attn.k_proj.{kind}"].unflatten(0, (nkv, d))[kv_heads].flatten(0, 1)
            v = hf[p + f"self_attn.v_proj.{kind}"].unflatten(0, (nkv, d))[kv_heads].flatten(0, 1)
            out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([q, k, v])
        o_proj = hf[p + "self_attn.o_proj.weight"]
        out[p + "self_attn.o_proj.weight"] = o_proj.unflatten(1, (nh, d))[:, q_heads].flatten(1)
        if "num_experts" in cfg or "num_local_experts" in cfg:  # FusedMoE: every expert, split by TP
            n, m = cfg.get("num_experts") or cfg["num_local_experts"], cfg["moe_intermediate_size"]
            rows_m = slice(r * m // R, (r + 1) * m // R)
            x = [f"{p}mlp.experts.{e}." for e in range(n)]
            out[p + "mlp.gate.weight"] = hf[p + "mlp.gate.weight"]
            out[p + "mlp.experts.w13_weight"] = torch.stack([torch.cat([hf[e + "gate_proj.weight"][rows_m],
                                                                        hf[e + "up_proj.weight"][rows_m]]) for e in x])
            out[p + "mlp.experts.w2_weight"] = torch.stack([hf[e + "down_proj.weight"][:, rows_m] for e in x])
        else:
            rows_i = slice(r * inter // R, (r + 1) * inter // R)
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"][rows_i],
                                                            hf[p + "mlp.up_proj.weight"][rows_i]])
            out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"][:, rows_i]
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        for norm in ("q_norm", "k_norm"):  # Qwen3's QK-norm, replicated
            if p + f"self_attn.{norm}.weight" in hf:
                out[p + f"self_attn.{norm}.weight"] = hf[p + f"self_attn.{norm}.weight"]
    return out


def trainer_shards(spec, dims: ParallelDims, rank: int, hf: dict, dtype: torch.dtype, padded_vocab: int) -> dict:
    """A trainer rank's Megatron tensors by canonical name, read from HF through the mapping (Megatron's own
    layout is checked against it above); none on an engine's rank."""
    if rank >= dims.world_size:
        return {}
    at = dims.coords(rank)

    def read(name, dim, start, stop):
        return hf[name].narrow(dim, start, stop - start).to(dtype)

    return {r.mcore: to_mcore_shard(r, spec, read, at["tp"], dims.tp, padded_vocab).contiguous()
            for r in param_rules(spec) if pipeline_stage(r.mcore, spec, dims.pp, dims.vpp) == at["pp"]}


class EngineModel:
    """What megarl's loader sees of an engine's model: named parameters."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())


class Reports:
    """An engine rank's checksums of its parameters, as the engine reports them (megarl.reshard.verify)."""

    def __init__(self, names: list[str], params: dict) -> None:
        self.names, self.params = names, params

    def checksums(self, num_tensors: int) -> torch.Tensor:
        assert num_tensors == len(self.names)
        return torch.stack([tensor_checksum(self.params[n]) for n in self.names]) if self.names \
            else torch.zeros(0, 2, dtype=torch.int64)


def check_engines_apart(plan: Plan, rank: int, hf: dict, cfg: dict, dtype: torch.dtype,
                        group: dist.ProcessGroup | None = None) -> dict:
    """A hand-over to engines on GPUs of their own (``plan.separate``) as GPU ``rank`` of ``group`` sees it: a
    direct refit into NaN-filled engine tensors, then the engine's own copy round by round (it lands the bytes and
    copies them into its parameters), both against HF slicing, the checksums (expected, and ``verify``'s gather of
    every member's report) over the group, and the bytes received against those the engine rank needs."""
    cpu = torch.device("cpu")
    src = trainer_shards(plan.spec, plan.dims, rank, hf, dtype, plan.padded_vocab)
    engine = plan.engine_rank(rank) >= 0
    ref = {n: t.to(dtype) for n, t in reference_engine(hf, cfg, plan.rollout_tp, plan.engine_rank(rank)).items()} \
        if engine else {}

    def nans() -> dict[str, torch.Tensor]:
        tensors = engine_tensor_allocations(plan, rank, dtype, cpu) if engine else {}
        for t in tensors.values():
            t.fill_(float("nan"))
        return tensors

    dst = nans()
    Resharder(plan, rank, src, dst, group=group, device=cpu).refit()
    side = Resharder(plan, rank, src, None, group=group, device=cpu, in_engine=True, landing_bytes=plan.bucket_bytes,
                     dtype=dtype)
    params = nans()
    state, model = HandoverState(), EngineModel(params)
    if engine:
        state.handle(model, side.engine_copy().to_wire("actor"))
    for r in range(side.num_rounds):
        side.refit(r)
        if engine:
            state.handle(model, apply_message("actor", torch.zeros(1), r))
    expected = side.expected_checksums()  # collective: every member, the engines' with nothing to add
    side.verify(Reports(side.dst_names, params), 0)
    # The engine worker's own side (megarl.reshard.receiver), sent as the trainer does: into the engine's
    # parameters where they all match the layout, else into tensors of its own.
    received = {}
    for mode, own in (("in_place", nans), ("load", dict)):
        if engine:
            receiver = EngineReceiver(plan, rank, group, params=own(), dtype=dtype, device=cpu)
            got = receiver.receive()
            received[mode] = receiver.in_place == (mode == "in_place") and all(torch.equal(got[n], ref[n])
                                                                               for n in ref)
        else:
            Resharder(plan, rank, src, {}, group=group, device=cpu).refit()
    return {"R": plan.rollout_tp, "rank": rank, "engine": engine, "src": len(src),
            "exact": sorted(ref) == sorted(dst) and all(torch.equal(dst[n], ref[n]) for n in ref),
            "in_engine": all(torch.equal(params[n], ref[n]) for n in ref),
            "receiver": received,
            "verified": torch.equal(torch.stack([tensor_checksum(params[n]) for n in side.dst_names]), expected)
            if engine else len(expected) == 0,
            "received": sum(t.nbytes for b in plan.buckets for t in b if t.dst_rank == rank),
            "needed": sum(t.numel() * t.element_size() for t in ref.values()) - sum(
                (ref[n].shape[0] - start) * ref[n][0].numel() * ref[n].element_size()
                for n, start in padding_rows(plan, rank).items()),
            "rounds": side.num_rounds}

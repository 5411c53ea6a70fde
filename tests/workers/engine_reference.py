"""Engine tensors the way an engine's weight loader slices full HF tensors, and a trainer rank's Megatron shards
read from HF through the mapping: the references of the resharding workers, without megatron-core (engine workers
outside the trainer's world import only this)."""

import math

import torch

from megarl.distributed.parallel import ParallelDims
from megarl.models.mapping import param_rules, pipeline_stage, to_mcore_shard


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
            for r in param_rules(spec) if pipeline_stage(r.mcore, spec, dims.pp) == at["pp"]}


class EngineModel:
    """What megarl's loader sees of an engine's model: named parameters."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def named_parameters(self):
        return iter(self.params.items())

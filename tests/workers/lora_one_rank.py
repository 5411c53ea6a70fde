"""One-process worker for test_lora.py: LoRA adapters (megarl.lora) on tiny Megatron models in a gloo world of one.

python tests/workers/lora_one_rank.py OUT_JSON LLAMA_DIR QWEN2_DIR QWEN3_MOE_DIR
A process of its own because megatron needs the CPU shim, which stays installed for the life of the process (it
would change every later test of a pytest run). Writes what each check measured; test_lora.py judges it.
"""

import json
import sys

import torch

from megarl.platform import init_platform

platform = init_platform()

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megarl.config.lora import LoraConfig  # noqa: E402
from megarl.distributed.parallel import ParallelDims, init_model_parallel, model_parallel_seed  # noqa: E402
from megarl.errors import UserError  # noqa: E402
from megarl.lora.layers import LoraAdapter, adapters_disabled, apply_lora, merged_weights  # noqa: E402
from megarl.models.gpt import BuildOptions, build_model, load_hf_weights  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402

ALL = ["qkv", "o", "fc1", "fc2"]


def build(path, groups):
    opts = BuildOptions()
    model_parallel_seed(1)
    spec = load_spec(path)
    chunks = build_model(spec, groups, opts)
    load_hf_weights(chunks, spec, str(path), groups, opts)
    return spec, chunks[0]


def tokens(spec):
    return torch.randint(0, spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model, spec, ids):
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return model(input_ids=ids, position_ids=positions, attention_mask=None)[..., :spec.vocab_size]


def randomize_b(model):
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraAdapter):
                module.B.copy_(torch.randn(module.B.shape, generator=gen) * 0.05)


def next_token_loss(out, ids):
    return F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def max_diff(a, b):
    return (a - b).abs().max().item()


def zero_b(path, groups):
    spec, model = build(path, groups)
    ids = tokens(spec)
    with torch.no_grad():
        before = logits(model, spec, ids)
        params = apply_lora([model], LoraConfig(rank=4, target_modules=ALL))
        after = logits(model, spec, ids)
    return {"params": len(params), "expected_params": 2 * len(ALL) * spec.num_layers,
            "a_nonzero": all(bool(p.abs().sum() > 0) for p in params[0::2]),
            "b_zero": all(bool(p.abs().sum() == 0) for p in params[1::2]), "exact": torch.equal(before, after)}


def merged(path, groups, rslora):
    spec, model = build(path, groups)
    ids = tokens(spec)
    with torch.no_grad():
        base = logits(model, spec, ids)
    apply_lora([model], LoraConfig(rank=4, alpha=8.0, rslora=rslora, target_modules=ALL))
    randomize_b(model)
    weights = merged_weights(model)
    _, plain = build(path, groups)
    with torch.no_grad():
        params = dict(plain.named_parameters())
        for name, weight in weights.items():
            params[name].copy_(weight)
        lora_out, merged_out = logits(model, spec, ids), logits(plain, spec, ids)
    return {"names": sorted({name.split(".", 3)[3] for name in weights}), "count": len(weights),
            "moved": max_diff(lora_out, base), "diff": max_diff(lora_out, merged_out)}


def disabled(path, groups):
    spec, model = build(path, groups)
    ids = tokens(spec)
    with torch.no_grad():
        base = logits(model, spec, ids)
        apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "fc2"]))
        randomize_b(model)
        with adapters_disabled([model]):
            off = logits(model, spec, ids)
        on = logits(model, spec, ids)
    return {"exact": torch.equal(off, base), "on_moved": max_diff(on, base)}


def gradients(path, groups):
    """Every adapter of one layer against s * B A x by hand in float64, given the layer's input x and the loss's
    gradient dy at its output: dB = s dy^T (x A^T), dA = s (dy B)^T x, summed over tokens."""
    spec, model = build(path, groups)
    base_params = list(model.parameters())
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    apply_lora([model], cfg)
    randomize_b(model)
    layer = model.decoder.layers[1]
    linears = {"qkv": layer.self_attention.linear_qkv, "o": layer.self_attention.linear_proj,
               "fc1": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2}
    seen = {}

    def record(module, args, output):  # registered after the adapter's hook: sees the adapted output
        seen[module] = [args[0].detach()]
        output[0].register_hook(lambda grad: seen[module].append(grad))

    for linear in linears.values():
        linear.register_forward_hook(record)
    ids = tokens(spec)
    next_token_loss(logits(model, spec, ids), ids).backward()
    out = {"base_frozen": all(not p.requires_grad and p.grad is None for p in base_params)}
    for target, linear in linears.items():
        x, dy = (t.double().flatten(0, 1) for t in seen[linear])
        a, b, s = linear.lora.A.double(), linear.lora.B.double(), cfg.scaling
        d_b, d_a = s * dy.T @ (x @ a.T), s * (dy @ b).T @ x
        out[target] = {"ref_max": min(d_a.abs().max().item(), d_b.abs().max().item()),
                       "a_rel": max_diff(linear.lora.A.grad.double(), d_a) / d_a.abs().max().item(),
                       "b_rel": max_diff(linear.lora.B.grad.double(), d_b) / d_b.abs().max().item()}
    return out


def against_peft(path, groups):
    """peft's LoRA on o_proj and down_proj with our adapters' A and B (the same matrices: neither layer's input is
    regrouped between HF and Megatron): logits, loss and adapter gradients."""
    try:
        import peft
    except ImportError:
        return None
    from transformers import AutoModelForCausalLM

    spec, model = build(path, groups)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["o", "fc2"])
    apply_lora([model], cfg)
    randomize_b(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,
                                                 target_modules=["o_proj", "down_proj"]))
    pairs = []
    with torch.no_grad():
        for i, layer in enumerate(model.decoder.layers):
            hf_layer = hf.base_model.model.model.layers[i]
            for ours, theirs in ((layer.self_attention.linear_proj, hf_layer.self_attn.o_proj),
                                 (layer.mlp.linear_fc2, hf_layer.mlp.down_proj)):
                theirs.lora_A["default"].weight.copy_(ours.lora.A)
                theirs.lora_B["default"].weight.copy_(ours.lora.B)
                pairs.append((ours.lora, theirs.lora_A["default"].weight, theirs.lora_B["default"].weight))
    ids = tokens(spec)
    ours_out, theirs_out = logits(model, spec, ids), hf(input_ids=ids).logits
    with torch.no_grad(), hf.disable_adapter():
        theirs_base = hf(input_ids=ids).logits
    ours_loss, theirs_loss = next_token_loss(ours_out, ids), next_token_loss(theirs_out, ids)
    ours_loss.backward()
    theirs_loss.backward()
    return {"version": peft.__version__, "logits": max_diff(ours_out, theirs_out),
            "moved": max_diff(theirs_out, theirs_base),
            "loss": abs(ours_loss.item() - theirs_loss.item()),
            "grad_min": min(adapter.A.grad.abs().max().item() for adapter, _, _ in pairs),
            "grads": max(max(max_diff(adapter.A.grad, a.grad), max_diff(adapter.B.grad, b.grad))
                         for adapter, a, b in pairs)}


def moe(path, groups):
    spec, model = build(path, groups)
    try:
        apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "fc1"]))
        refused = ""
    except UserError as err:
        refused = str(err)
    untouched = all(p.requires_grad for p in model.parameters())
    attention = len(apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "o"])))
    return {"refused": refused, "untouched": untouched, "attention_params": attention,
            "expected": 4 * spec.num_layers}


def rank_zero(path, groups):
    _, model = build(path, groups)
    return {"params": len(apply_lora([model], LoraConfig(rank=0))),
            "trainable": all(p.requires_grad for p in model.parameters())}


def main() -> None:
    out, llama, qwen2, qwen3_moe = sys.argv[1:5]
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=0, world_size=1)
    groups = init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    results = {"zero_b": {"llama": zero_b(llama, groups), "qwen2": zero_b(qwen2, groups)},
               "merged": {"llama": merged(llama, groups, rslora=False), "qwen2": merged(qwen2, groups, rslora=True)},
               "disabled": disabled(llama, groups), "gradients": gradients(qwen2, groups),
               "peft": against_peft(llama, groups), "moe": moe(qwen3_moe, groups),
               "rank_zero": rank_zero(llama, groups)}
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

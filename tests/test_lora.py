"""LoRA adapters on Megatron's linear layers (megarl.lora), in this process as a gloo world of one: B = 0 is the base
model exactly; random adapters equal the merged weights W + s B A; gradients reach only the adapters and equal a
float64 reference; peft's LoRA on the transformers model gives the same logits and adapter gradients;
adapters_disabled is the base model. Multi-rank layouts (TP2 with SP, PP2): tests/test_lora_layouts.py."""

from __future__ import annotations

import pytest
import torch

from megarl.platform import init_platform

init_platform()  # the CPU shim must precede megatron's import

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from helpers import make_hf_model  # noqa: E402
from megarl.configio import FieldError, show  # noqa: E402
from megarl.errors import UserError  # noqa: E402
from megarl.lora.config import LoraConfig  # noqa: E402
from megarl.lora.layers import LoraAdapter, adapters_disabled, apply_lora, merged_weights  # noqa: E402
from megarl.models.gpt import BuildOptions, build_model, load_hf_weights  # noqa: E402
from megarl.models.spec import load_spec  # noqa: E402
from megarl.parallel import ParallelDims, destroy_model_parallel, init_model_parallel, model_parallel_seed  # noqa: E402

ALL = ["qkv", "o", "fc1", "fc2"]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('store') / 'store'}", rank=0,
                            world_size=1)
    yield init_model_parallel(ParallelDims(tp=1, pp=1, dp=1))
    destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_model(root / family, family) for family in ("llama", "qwen2")}


def build(path, groups):
    opts = BuildOptions()
    model_parallel_seed(1)
    spec = load_spec(path)
    chunks = build_model(spec, groups, opts)
    load_hf_weights(chunks, spec, str(path), groups, opts)
    return spec, chunks[0]


def tokens(spec, seed=0):
    return torch.randint(0, spec.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))


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


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_zero_b_is_the_base_model_exactly(groups, models, family):
    spec, model = build(models[family], groups)
    ids = tokens(spec)
    with torch.no_grad():
        before = logits(model, spec, ids)
        params = apply_lora([model], LoraConfig(rank=4, target_modules=ALL))
        after = logits(model, spec, ids)
    assert len(params) == 2 * 4 * spec.num_layers
    assert all(p.abs().sum() > 0 for p in params[0::2]) and all(p.abs().sum() == 0 for p in params[1::2])
    assert torch.equal(before, after)


@pytest.mark.parametrize("family,rslora", [("llama", False), ("qwen2", True)])
def test_random_adapters_equal_the_merged_weights(groups, models, family, rslora):
    spec, model = build(models[family], groups)
    ids = tokens(spec)
    with torch.no_grad():
        base = logits(model, spec, ids)
    apply_lora([model], LoraConfig(rank=4, alpha=8.0, rslora=rslora, target_modules=ALL))
    randomize_b(model)
    merged = merged_weights(model)
    assert {name.split(".", 3)[3] for name in merged} == {
        "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight"}
    _, plain = build(models[family], groups)
    with torch.no_grad():
        params = dict(plain.named_parameters())
        for name, weight in merged.items():
            params[name].copy_(weight)
        lora_out, merged_out = logits(model, spec, ids), logits(plain, spec, ids)
    assert (lora_out - base).abs().max() > 1e-2  # the adapters do change the model
    assert (lora_out - merged_out).abs().max() < 1e-6


def test_adapters_disabled_give_the_base_logits(groups, models):
    spec, model = build(models["llama"], groups)
    ids = tokens(spec)
    with torch.no_grad():
        base = logits(model, spec, ids)
        apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "fc2"]))
        randomize_b(model)
        with adapters_disabled([model]):
            off = logits(model, spec, ids)
        on = logits(model, spec, ids)
    assert torch.equal(off, base)
    assert (on - base).abs().max() > 1e-2


def test_gradients_reach_only_the_adapters_and_equal_a_float64_reference(groups, models):
    """Every adapter of one layer against s * B A x by hand in float64, given the layer's input x and the loss's
    gradient dy at its output: dB = s dy^T (x A^T), dA = s (dy B)^T x, summed over tokens."""
    spec, model = build(models["qwen2"], groups)
    base_params = list(model.parameters())
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)
    apply_lora([model], cfg)
    randomize_b(model)
    layer = model.decoder.layers[1]
    linears = [layer.self_attention.linear_qkv, layer.self_attention.linear_proj, layer.mlp.linear_fc1,
               layer.mlp.linear_fc2]
    seen = {}

    def record(module, args, output):  # registered after the adapter's hook: sees the adapted output
        seen[module] = [args[0].detach()]
        output[0].register_hook(lambda grad: seen[module].append(grad))

    for linear in linears:
        linear.register_forward_hook(record)
    ids = tokens(spec)
    next_token_loss(logits(model, spec, ids), ids).backward()
    assert all(not p.requires_grad and p.grad is None for p in base_params)
    for linear in linears:
        x, dy = (t.double().flatten(0, 1) for t in seen[linear])
        a, b, s = linear.lora.A.double(), linear.lora.B.double(), cfg.scaling
        d_b = s * dy.T @ (x @ a.T)
        d_a = s * (dy @ b).T @ x
        assert d_a.abs().max() > 1e-4 and d_b.abs().max() > 1e-4
        assert torch.allclose(linear.lora.B.grad.double(), d_b, rtol=1e-4, atol=1e-7)
        assert torch.allclose(linear.lora.A.grad.double(), d_a, rtol=1e-4, atol=1e-7)


def test_o_and_fc2_match_peft_on_the_transformers_model(groups, models):
    """peft's LoRA on o_proj and down_proj with our adapters' A and B (the same matrices: neither layer's input is
    regrouped between HF and Megatron): the same logits, loss and adapter gradients."""
    peft = pytest.importorskip("peft", reason="peft is not installed (not in requirements); "
                                              "the float64 reference test covers the gradients")
    from transformers import AutoModelForCausalLM

    spec, model = build(models["llama"], groups)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=["o", "fc2"])
    apply_lora([model], cfg)
    randomize_b(model)
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32)
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
    assert (ours_out - theirs_out).abs().max() < 1e-5
    ours_loss, theirs_loss = next_token_loss(ours_out, ids), next_token_loss(theirs_out, ids)
    assert abs(ours_loss.item() - theirs_loss.item()) < 1e-5
    ours_loss.backward()
    theirs_loss.backward()
    for adapter, a, b in pairs:
        assert adapter.A.grad.abs().max() > 1e-5
        assert (adapter.A.grad - a.grad).abs().max() < 1e-5
        assert (adapter.B.grad - b.grad).abs().max() < 1e-5


def test_moe_expert_layers_are_refused(groups, tmp_path):
    spec, model = build(make_hf_model(tmp_path / "moe", "qwen3_moe"), groups)
    with pytest.raises(UserError, match="MoE expert layers"):
        apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "fc1"]))
    assert all(p.requires_grad for p in model.parameters())  # the refusal left the model as it was
    assert len(apply_lora([model], LoraConfig(rank=4, target_modules=["qkv", "o"]))) == 4 * spec.num_layers


def test_rank_zero_changes_nothing(groups, models):
    _, model = build(models["llama"], groups)
    assert apply_lora([model], LoraConfig(rank=0)) == []
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kwargs,field,fix", [
    (dict(rank=-1), "rank", "use 0"),
    (dict(alpha=0.0), "alpha", "use 16"),
    (dict(dropout=0.1), "dropout", "set dropout: 0.0"),
    (dict(target_modules=["qkv", "fc3"]), "target_modules", "use 'fc2'"),
    (dict(target_modules=["down_proj"]), "target_modules", "use 'fc2'"),
    (dict(target_modules=["o", "o"]), "target_modules", "list each module once"),
    (dict(rank=8, target_modules=[]), "target_modules", "at least one"),
])
def test_config_errors_name_the_field_value_and_fix(kwargs, field, fix):
    with pytest.raises(FieldError) as err:
        LoraConfig(**kwargs)
    assert err.value.field == field and fix in str(err.value)
    assert f"= {show(kwargs[field])}," in str(err.value)


def test_scaling_is_alpha_over_r_or_over_sqrt_r():
    assert LoraConfig(rank=16, alpha=32.0).scaling == 2.0
    assert LoraConfig(rank=16, alpha=32.0, rslora=True).scaling == 8.0

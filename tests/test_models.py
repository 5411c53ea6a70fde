"""HF config/weights reading, the HF <-> Megatron mapping, and the convert CLI (no megatron import)."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import REPO, make_hf_model
from megarl.errors import UserError
from megarl.models.hf_io import HFReader
from megarl.models.mapping import hf_shapes, param_rules, to_hf, to_mcore_shard
from megarl.models.mcore_ckpt import check_layout
from megarl.models.spec import load_spec


def convert(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megarl.convert", *args], cwd=REPO, capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("m") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("m") / "qwen2", "qwen2", max_shard_size="100KB",
                         dtype=torch.bfloat16)


def all_tensors(model_dir):
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")


def test_spec_reads_qwen3_qk_norm_and_head_dim(qwen3):
    s = load_spec(qwen3)
    assert (s.family, s.qk_norm, s.qkv_bias, s.head_dim, s.hidden_size) == ("qwen3", True, False, 32, 64)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3)
    assert s.num_params() == sum(p.numel() for p in hf.parameters())
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == hf_shapes(s)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("m") / "qwen3_moe", "qwen3_moe")


def test_spec_reads_qwen3_moe_experts(qwen3_moe, tmp_path):
    s = load_spec(qwen3_moe)
    assert (s.family, s.is_moe, s.qk_norm, s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size,
            s.norm_topk_prob) == ("qwen3_moe", True, True, 8, 2, 32, True)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_moe)  # transformers fuses the experts in memory, not on disk
    assert s.num_params() == sum(p.numel() for p in hf.parameters())
    assert {n: tuple(t.shape) for n, t in all_tensors(qwen3_moe).items()} == hf_shapes(s)
    config = json.loads((qwen3_moe / "config.json").read_text())
    for bad, message in [({"decoder_sparse_step": 2}, "experts in every layer"), ({"mlp_only_layers": [1]},
                         "experts in every layer"), ({"num_experts_per_tok": 9}, "between 1 and num_experts=8")]:
        (tmp_path / "config.json").write_text(json.dumps(config | bad))
        with pytest.raises(UserError, match=message):
            load_spec(tmp_path)


def test_qwen3_moe_without_norm_topk_prob_routes_as_transformers_does(qwen3_moe, tmp_path):
    """A config.json without norm_topk_prob: transformers' Qwen3MoeConfig default (no renormalisation), not True."""
    import transformers

    config = json.loads((qwen3_moe / "config.json").read_text())
    del config["norm_topk_prob"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = transformers.AutoConfig.from_pretrained(tmp_path).norm_topk_prob
    assert expected == transformers.Qwen3MoeConfig().norm_topk_prob
    assert load_spec(tmp_path).norm_topk_prob == expected


def test_sliding_window_attention_is_refused(qwen2, tmp_path):
    """Megatron attends to every earlier token; transformers slides the window in the layers these configs name."""
    import transformers

    config = json.loads((qwen2 / "config.json").read_text())
    assert set(config["layer_types"]) == {"full_attention"}  # Qwen2.5's kind of config.json loads
    load_spec(qwen2)
    sliding = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    layers = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    for bad, message in [(sliding | {"layer_types": None}, r"use_sliding_window=True \(sliding_window=16, "
                                                           r"max_window_layers=2\): sliding-window attention"),
                         ({"layer_types": layers}, r"layer_types holds \['sliding_attention'\]: sliding-window")]:
        (tmp_path / "config.json").write_text(json.dumps(config | bad))
        assert "sliding_attention" in transformers.AutoConfig.from_pretrained(tmp_path).layer_types
        with pytest.raises(UserError, match=rf"^model.hf_path = '{tmp_path}': .*{message}.* Fix: use a model with "
                                            "full attention in every layer"):
            load_spec(tmp_path, "model.hf_path")


@pytest.mark.parametrize(("bad", "message"), [
    ({"rope_parameters": {"rope_theta": "abc"}}, '`rope_parameters.rope_theta` is "abc", but it must be a positive '
                                                 "finite number"),
    ({"rope_parameters": [1]}, r"`rope_parameters` is \[1\], but it must be a JSON object"),
    ({"rope_scaling": "linear"}, '`rope_scaling` is "linear", but it must be a JSON object'),
    ({"vocab_size": None}, "`vocab_size` is null, but it must be a positive integer"),
    ({"num_hidden_layers": "two"}, '`num_hidden_layers` is "two", but it must be a positive integer'),
    ({"num_attention_heads": 0}, "`num_attention_heads` is 0, but it must be a positive integer"),
    ({"num_key_value_heads": True}, "`num_key_value_heads` is true, but it must be a positive integer"),
    ({"rms_norm_eps": -1}, "`rms_norm_eps` is -1, but it must be a positive finite number"),
    ({"tie_word_embeddings": "yes"}, '`tie_word_embeddings` is "yes", but it must be true or false'),
    ({"layer_types": "full_attention"}, '`layer_types` is "full_attention", but it must be a list'),
    ({"architectures": "Qwen2ForCausalLM"}, r'`architectures` is "Qwen2ForCausalLM", not a list of class names\. '
                                            r'Write .* "architectures": \["Qwen2ForCausalLM"\]'),
    ({"architectures": "DELETE"}, r'`architectures` is missing\. Write .* "architectures": \["Qwen2ForCausalLM"\]'),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     r"`rope_scaling.high_freq_factor` is 4.0, but it must be above rope_scaling.low_freq_factor \(4.0\)"),
])
def test_damaged_config_values_name_the_field(qwen2, tmp_path, bad, message):
    """load_spec reads config.json before transformers does: a damaged value is a paragraph, not a traceback."""
    config = {k: v for k, v in (json.loads((qwen2 / "config.json").read_text()) | bad).items() if v != "DELETE"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"^model.hf_path = '{tmp_path}': {tmp_path}/config.json: {message}"):
        load_spec(tmp_path, "model.hf_path")


def test_export_states_the_dtype_it_writes(llama, tmp_path):
    """An fp32 base trained in bf16 exports bf16 weights: config.json says bfloat16, so dtype="auto" loads them as
    written."""
    from transformers import AutoModelForCausalLM

    from megarl.models.hf_io import write_hf

    spec = load_spec(llama)
    assert spec.hf_config["dtype"] == "float32"
    write_hf(tmp_path / "hf", ((n, t.bfloat16()) for n, t in all_tensors(llama).items()), spec, source_dir=llama)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == spec.hf_config | {"dtype": "bfloat16"}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").dtype == torch.bfloat16
    old = spec.hf_config | {"torch_dtype": "float32"}  # transformers 4's key
    del old["dtype"]
    write_hf(tmp_path / "hf4", ((n, t.bfloat16()) for n, t in all_tensors(llama).items()),
             dataclasses.replace(spec, hf_config=old))
    assert json.loads((tmp_path / "hf4" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_spec_reads_llama3_rope_and_qwen2_tied(llama, qwen2):
    s = load_spec(llama)
    assert (s.family, s.num_kv_heads, s.head_dim, s.tie_word_embeddings) == ("llama", 2, 16, False)
    assert s.rope_scaling["rope_type"] == "llama3" and s.rope_theta == 500000.0
    q = load_spec(qwen2)
    assert (q.family, q.qkv_bias, q.tie_word_embeddings) == ("qwen2", True, True)
    assert q.padded_vocab_size(tp=2, multiple=128) == 256


@pytest.mark.parametrize("model", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_mapping_round_trip_is_exact(request, model, tp):
    src = request.getfixturevalue(model)
    spec = load_spec(src)
    reader = HFReader(src, spec, hf_shapes(spec))
    padded = spec.padded_vocab_size(tp, 128)
    ref = all_tensors(src)
    for rule in param_rules(spec):
        shards = [to_mcore_shard(rule, spec, reader.read, r, tp, padded) for r in range(tp)]
        for name, tensor in to_hf(rule, spec, shards).items():
            assert torch.equal(tensor, ref[name]), name


def test_qkv_shard_is_group_interleaved(llama):
    spec = load_spec(llama)
    reader = HFReader(llama, spec, hf_shapes(spec))
    rule = next(r for r in param_rules(spec) if r.mcore.endswith("0.self_attention.linear_qkv.weight"))
    shard = to_mcore_shard(rule, spec, reader.read, 1, 2, 256)  # TP rank 1 of 2 holds query group 1
    d, qpg = spec.head_dim, spec.q_per_group
    q, k, v = (reader.read(n, None, 0, 0) for n in rule.hf)
    expected = torch.cat([q[qpg * d: 2 * qpg * d], k[d: 2 * d], v[d: 2 * d]])
    assert torch.equal(shard, expected)


def test_vocab_shard_pads_with_zero_rows(llama):
    spec = load_spec(llama)
    reader = HFReader(llama, spec, hf_shapes(spec))
    rule = param_rules(spec)[0]
    shard = to_mcore_shard(rule, spec, reader.read, 1, 2, 256)  # rows 128..255 of a 200-row vocab
    assert torch.equal(shard[:72], reader.read("model.embed_tokens.weight", 0, 128, 200))
    assert not shard[72:].any()


@pytest.mark.parametrize("model,tp,pp", [("llama", 2, 2), ("qwen2", 2, 1), ("qwen2", 1, 4), ("qwen3", 2, 2),
                                         ("qwen3_moe", 2, 2)])
def test_convert_round_trip_is_bit_exact(request, tmp_path, model, tp, pp):
    src = request.getfixturevalue(model)
    proc = convert("hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--tp", str(tp), "--pp", str(pp))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "mc" / "megarl_checkpoint.json").read_text())
    assert (meta["tp"], meta["pp"]) == (tp, pp)
    assert len(list((tmp_path / "mc").glob("tp*_pp*.safetensors"))) == tp * pp
    proc = convert("mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    ref, out = all_tensors(src), all_tensors(tmp_path / "hf")
    assert ref.keys() == out.keys()
    for name in ref:
        assert ref[name].dtype == out[name].dtype and torch.equal(ref[name], out[name]), name
    assert (src / "config.json").read_bytes() == (tmp_path / "hf" / "config.json").read_bytes()


def test_exported_model_loads_in_transformers(llama, tmp_path):
    from transformers import AutoModelForCausalLM

    assert convert("hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "mc"), "--tp", "2").returncode == 0
    assert convert("mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf")).returncode == 0
    tokens = torch.tensor([[1, 2, 3, 4]])
    a = AutoModelForCausalLM.from_pretrained(llama)(tokens).logits
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(tokens).logits
    assert torch.equal(a, b)


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _bad_inputs(llama, tmp):
    cases = {"missing dir": (tmp / "nope", "does not exist")}
    no_cfg = _copy(llama, tmp / "no_cfg")
    (no_cfg / "config.json").unlink()
    cases["no config.json"] = (no_cfg, "no config.json")
    corrupt = _copy(llama, tmp / "corrupt")
    (corrupt / "config.json").write_text("{not json")
    cases["corrupt config"] = (corrupt, "not valid JSON")
    arch = _copy(llama, tmp / "arch")
    cfg = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    cases["unsupported arch"] = (arch, "not supported")
    shape = _copy(llama, tmp / "shape")
    (shape / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 256}))
    cases["shape mismatch"] = (shape, "has shape")
    missing = _copy(llama, tmp / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    cases["missing tensor"] = (missing, "lacks 1 tensor")
    broken = _copy(llama, tmp / "broken")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    cases["corrupt safetensors"] = (broken, "not a readable safetensors")
    return cases


def test_convert_refuses_a_tp_that_does_not_split_the_heads_or_the_mlp(llama):
    """Else the MLP's shards rounded down: a zero row in fc1, columns of fc2 lost, no error (and the export's
    uncovered rows were uninitialised memory)."""
    spec = load_spec(llama)
    check_layout(spec, 2, 1)
    with pytest.raises(UserError, match=r"--tp 2 must divide num_attention_heads=.* and the MLP width 63 .*use one of"):
        check_layout(dataclasses.replace(spec, intermediate_size=63), 2, 1)


def test_bad_hf_dirs_are_user_errors(llama, tmp_path):
    for path, needle in _bad_inputs(llama, tmp_path).values():
        with pytest.raises(UserError, match=needle):
            spec = load_spec(path)
            HFReader(path, spec, hf_shapes(spec))


def test_convert_cli_bad_input_exits_2_without_traceback(llama, tmp_path):
    step = tmp_path / "run" / "step_3"
    for model in ("actor", "critic"):  # a training step's checkpoint holds one directory per model
        (step / model).mkdir(parents=True)
        (step / model / "megarl_checkpoint.json").write_text("{}")
    cases = [
        (["mcore-to-hf", "--ckpt", str(step), "--out", str(tmp_path / "o6")], f"e.g. `{step / 'actor'}` (it holds "
                                                                              "actor, critic)"),
        (["hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")], "does not exist"),
        (["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o2"), "--tp", "4"], "--tp 4 must divide"),
        (["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o3"), "--pp", "3"], "--pp 3 must divide"),
        (["mcore-to-hf", "--ckpt", str(llama), "--out", str(tmp_path / "o4")], "not a megarl Megatron checkpoint"),
        (["hf-to-mcore", "--hf", str(llama), "--out", str(llama)], "exists and is not empty"),
        (["hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "o5"), "--vocab-pad-multiple", "0"],
         "argument --vocab-pad-multiple: '0' is not a whole number of at least 1"),
        (["hf-to-mcore", "--hf", str(llama), "--out", str(llama / "config.json")],
         f"--out {llama / 'config.json'} is an existing file, not a directory"),
    ]
    for args, needle in cases:
        proc = convert(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o2").exists()


def test_incomplete_checkpoint_is_rejected(llama, tmp_path):
    assert convert("hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "mc"), "--tp", "2").returncode == 0
    (tmp_path / "mc" / "tp01_pp00.safetensors").unlink()
    proc = convert("mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "missing or unreadable" in proc.stderr
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_whose_sizes_are_not_positive_is_refused_by_name(llama, tmp_path):
    """tp 0 (or pp 0, or a negative size) passed the int check and failed deep in the mapping (IndexError)."""
    assert convert("hf-to-mcore", "--hf", str(llama), "--out", str(tmp_path / "mc")).returncode == 0
    meta_file = tmp_path / "mc" / "megarl_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    for key, value in [("tp", 0), ("pp", 0), ("tp", -2), ("ep", 0)]:
        meta_file.write_text(json.dumps(meta | {key: value}))
        proc = convert("mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf"))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{meta_file} is corrupt: `{key}` is {value}, but it must be a positive integer" in proc.stderr
    assert not (tmp_path / "hf").exists()

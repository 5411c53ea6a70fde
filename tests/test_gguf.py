"""gguf-to-hf on a small GGUF written here with the gguf package's writer: the HF directory it makes gives the
logits of the model the GGUF was written from, which transformers' own GGUF reader gives too, and the same
greedy decode; it loads as a megarl model (config, tokenizer, chat template)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megarl.errors import UserError

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["the cat sat on the mat", "what is twelve plus thirty", "the answer is forty two", "user assistant"]


def bpe_tokenizer() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary and its merges, trained here (no hub), with the two chat tokens at the end."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 4, trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    vocab = sorted(state["vocab"], key=state["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return vocab, merges


def write_gguf(path: Path, extra: Callable[[Any], None] = lambda writer: None) -> torch.nn.Module:
    """A random tiny Llama (tied embeddings, 3 query heads per KV head) written as an F32 GGUF the way llama.cpp
    lays one out: its tensor names, and q/k rows regrouped into the interleaved-pair RoPE order it uses;
    ``extra(writer)`` adds keys or tensors."""
    import transformers

    vocab, merges = bpe_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=48, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                      max_position_embeddings=128, rope_theta=50000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.02 if "norm" in name else 0.2)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(48)
    writer.add_feed_forward_length(96)
    writer.add_head_count(6)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    head_dim = 8
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: GGUF stores the embedding once
        base, suffix = name.rsplit(".", 1)
        data = tensor.float()
        heads = {"q_proj": 6, "k_proj": 2}.get(base.rsplit(".", 1)[-1])
        if heads:  # HF's rotate-half halves -> llama.cpp's adjacent pairs, per head
            data = data.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(data.shape)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data.numpy())
    extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_gguf_to_hf_matches_the_model_it_was_written_from(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenizer import load_tokenizer
    from megarl.models.gguf_import import gguf_to_hf
    from megarl.models.spec import load_spec

    source = write_gguf(tmp_path / "tiny.gguf")
    gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", dtype="float32")
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 50000.0
    assert "quantization_config" not in config
    spec = load_spec(out)
    assert (spec.num_kv_heads, spec.tie_word_embeddings, spec.rope_theta) == (2, True, 50000.0)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    tokenizer = load_tokenizer(str(out))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "what is twelve plus thirty"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]).startswith("<|im_start|>user\nwhat is twelve plus thirty<|im_end|>")
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = source(ids).logits
        assert torch.allclose(converted(ids).logits, expected, atol=1e-5)
        assert torch.allclose(theirs(ids).logits, expected, atol=1e-5)
        greedy = converted.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(greedy, source.generate(ids, max_new_tokens=12, do_sample=False))


def test_bad_gguf_input_is_named(tmp_path: Path) -> None:
    from megarl.models.gguf_import import gguf_to_hf

    with pytest.raises(UserError, match="no such file"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="transformers cannot read it"):
        gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out")
    write_gguf(tmp_path / "tiny.gguf")
    whole = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "header.gguf").write_bytes(whole[:200])  # cut inside the metadata: a struct.error traceback before
    with pytest.raises(UserError, match=r"header.gguf cannot be read .*the file \(200 bytes\) is truncated"):
        gguf_to_hf(tmp_path / "header.gguf", tmp_path / "out")
    (tmp_path / "data.gguf").write_bytes(whole[:-1000])  # cut inside the last tensor's data
    with pytest.raises(UserError, match="data.gguf (is truncated: its tensors end at byte|cannot be read .*truncated)"):
        gguf_to_hf(tmp_path / "data.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_with_scaled_rope_is_refused(tmp_path: Path) -> None:
    """transformers' GGUF reader drops a Llama/Qwen model's RoPE scaling (llama.cpp's `rope_freqs` tensor of Llama
    3.1/3.2, or rope.scaling.* keys): the converted model would give other logits, so the file is refused."""
    import numpy as np

    from megarl.models.gguf_import import gguf_to_hf

    def rope_freqs(writer: Any) -> None:  # llama.cpp's llama3 factors for head_dim 8: 1 (short) ... 8 (long)
        writer.add_tensor("rope_freqs.weight", np.array([1.0, 1.0, 2.5, 8.0], dtype=np.float32))

    def linear(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    for name, extra, held in [
            ("freqs", rope_freqs, "holds a `rope_freqs.weight` tensor (per-frequency RoPE factors: llama.cpp's form "
                                  "of Llama 3.1/3.2's `llama3` rope scaling)"),
            ("linear", linear, "holds llama.rope.scaling.factor = 4.0, llama.rope.scaling.type = 'linear'")]:
        write_gguf(tmp_path / f"{name}.gguf", extra)
        with pytest.raises(UserError) as err:
            gguf_to_hf(tmp_path / f"{name}.gguf", tmp_path / "out")
        assert str(err.value).startswith(f"--gguf {tmp_path / name}.gguf {held}: its RoPE is scaled")
        assert "Fix: convert from the original HuggingFace checkpoint" in str(err.value)
        assert not (tmp_path / "out").exists()
    # llama.cpp's "none", or a factor of 1, scales nothing: such a file converts
    def unit(writer: Any) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(1.0)

    for name, extra in [("none", lambda writer: writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)),
                        ("unit", unit)]:
        write_gguf(tmp_path / f"{name}.gguf", extra)
        gguf_to_hf(tmp_path / f"{name}.gguf", tmp_path / name, dtype="float32")
        assert json.loads((tmp_path / name / "config.json").read_text())["rope_parameters"]["rope_type"] == "default"

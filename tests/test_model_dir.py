"""A model directory's tokenizer and config.json are checked before anything is built."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import UserError

TINY = REPO / "recipes" / "tiny" / "model"


def copy_model(tmp_path: Path) -> Path:
    return Path(shutil.copytree(TINY, tmp_path / "model"))


def test_the_tiny_model_loads_and_encodes() -> None:
    assert load_tokenizer(str(TINY))("a 1")["input_ids"]


def test_a_directory_without_tokenizer_files_is_named(tmp_path: Path) -> None:
    """transformers builds an empty tokenizer from tokenizer_config.json alone; every prompt would encode to []."""
    model = copy_model(tmp_path)
    (model / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=rf"model.hf_path = '{model}' has no tokenizer: none of tokenizer.json"):
        load_tokenizer(str(model))


def test_a_config_that_transformers_rejects_is_named(tmp_path: Path) -> None:
    model = copy_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["full_attention"]  # 2 layers
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"transformers rejects .*config.json: .*`num_hidden_layers` \(2\) must be "
                                        r"equal to the number of `layer_types` \(1\)"):
        load_tokenizer(str(model))


def test_a_model_without_tokenizer_is_exit_2_before_any_worker_starts(tmp_path: Path) -> None:
    model = copy_model(tmp_path)
    (model / "tokenizer.json").unlink()
    proc = subprocess.run([sys.executable, "megarl/train.py", "--config", "recipes/tiny_cpu_grpo.yaml", "--set",
                           f"model.hf_path={model}", "--set", f"checkpoint.dir={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "MEGARL_NPROC": "1", "PATH": os.environ["PATH"]})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"megarl error: model.hf_path = '{model}' has no tokenizer")

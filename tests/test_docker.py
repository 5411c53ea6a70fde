"""The Dockerfile cannot be built here (no Docker engine): lint it and check what it refers to exists."""

import re
import shutil
import subprocess

import pytest

from helpers import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (requirements-dev.txt)")
def test_hadolint_is_clean():
    proc = subprocess.run(["hadolint", "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_copied_files_exist_and_pins_agree_with_the_project():
    for src in re.findall(r"^COPY (?:--\S+ )*(\S+) ", DOCKERFILE, re.MULTILINE):
        assert src == "." or (REPO / src).exists(), src
    gpu = (REPO / "docker" / "requirements-gpu.txt").read_text()
    cpu = (REPO / "requirements.txt").read_text()
    assert "megatron-core==0.16.1" in gpu and "megatron-core==0.16.1" in cpu
    assert "sglang[srt]==0.5.17" in gpu and "torch==2.11.0" in gpu  # SGLang 0.5.17 pins torch 2.11


def test_image_builds_the_cuda_extension_for_a100_and_hopper_and_runs_as_non_root():
    assert 'TORCH_CUDA_ARCH_LIST="8.0;9.0"' in DOCKERFILE
    assert "MEGARL_FORCE_CUDA=1" in DOCKERFILE and "C.with_cuda()" in DOCKERFILE
    assert re.search(r"^USER 1000:1000$", DOCKERFILE, re.MULTILINE)
    assert '"megarl/train.py"' in DOCKERFILE

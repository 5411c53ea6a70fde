"""The GPU-session scripts (benchmarks/*.sh), which only run on the lent GPU machines, at least parse, and the kernel
cache they carry between sessions survives the trip in parts small enough to come back from a device call."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted([*REPO.glob("benchmarks/*.sh"), *REPO.glob("benchmarks/h200/*.sh")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_session_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_kernel_cache_travels_in_parts_under_a_device_calls_file_limit(tmp_path):
    """cache-save cuts the caches into parts of at most 15 MiB (a file over 16 MiB does not come back); cache-load,
    given the parts in .stage/kernel_cache/, restores every file byte for byte, and of SGLang's JIT modules their
    .so files, which are all it reuses."""
    home, out, work = tmp_path / "home", tmp_path / "out", tmp_path / "work"
    cache = home / ".triton" / "cache"
    cache.mkdir(parents=True)
    out.mkdir()
    blob = os.urandom(20 * 2**20)  # random: gzip cannot shrink it below one part
    (cache / "kernel.bin").write_bytes(blob)
    (cache / "kernel.json").write_text('{"name": "k"}')
    jit = home / ".cache" / "tvm-ffi" / "sgl_kernel_jit_norm"  # SGLang's nvcc-built modules: the .so alone is reused
    jit.mkdir(parents=True)
    (jit / "sgl_kernel_jit_norm.so").write_bytes(b"module")
    (jit / "norm.cuda.o").write_bytes(b"object")
    env = os.environ | {"HOME": str(home), "OUT": str(out), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "none")}
    steps = f"source {REPO}/benchmarks/h200_common.sh; source {REPO}/benchmarks/h200/stage.sh;"
    subprocess.run(["bash", "-c", steps + " cache_save"], check=True, env=env, cwd=REPO, capture_output=True)
    parts = sorted(out.glob("kernel_cache.tgz.*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    (work / ".stage" / "kernel_cache").mkdir(parents=True)
    for p in parts:
        (work / ".stage" / "kernel_cache" / p.name).write_bytes(p.read_bytes())
    for f in [*cache.iterdir(), *jit.iterdir()]:
        f.unlink()
    subprocess.run(["bash", "-c", steps + " cache_load"], check=True, env=env, cwd=work, capture_output=True)
    assert (cache / "kernel.bin").read_bytes() == blob and (cache / "kernel.json").read_text() == '{"name": "k"}'
    assert (jit / "sgl_kernel_jit_norm.so").read_bytes() == b"module" and not (jit / "norm.cuda.o").exists()


def _packing_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A git repository holding the packing scripts alone, with an empty download cache: (repo, cache)."""
    repo = tmp_path / "repo"
    for name in ["benchmarks/h200_stage.sh", "benchmarks/h200_common.sh", "benchmarks/h200/stage.sh",
                 "benchmarks/h200/download.sh"]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes((REPO / name).read_bytes())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    cache = repo / ".stage" / "cache"
    cache.mkdir(parents=True)
    return repo, cache


def test_pack_carries_flashattention3_only_when_asked(tmp_path):
    """pack cuts every file of .stage/cache into the parts but SGLang's FlashAttention-3 module (1.1 GB unpacked,
    about 8 more device calls), which travels only with FA3=1; turning it on or off cuts the parts anew. The
    downloads are skipped: the cache already holds the kernels, and PYTHON=true stands in for pip."""
    repo, cache = _packing_repo(tmp_path)
    for name, size in [("sglang-0.5.17-py3-none-any.whl", 3000), ("sglang_kernel_slim.zip", 2000),
                       ("sglang_kernel_fa3.zip", 5000), ("bwrap", 100)]:
        (cache / name).write_bytes(os.urandom(size))

    def packed(**env):
        subprocess.run(["bash", "benchmarks/h200_stage.sh", "pack"], cwd=repo, check=True, capture_output=True,
                       env={k: v for k, v in os.environ.items() if k != "FA3"} | {"PYTHON": "true"} | env)
        parts = sorted((repo / ".stage").glob("p*/chunk.*"), key=lambda p: int(p.suffix[1:]))
        (tmp_path / "payload.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
        listing = subprocess.run(["tar", "tf", str(tmp_path / "payload.tar")], check=True, capture_output=True,
                                 text=True).stdout.split()
        return sorted(listing), (repo / ".stage" / "p1" / "MANIFEST").read_text()

    without, manifest = packed()
    assert without == ["bwrap", "sglang-0.5.17-py3-none-any.whl", "sglang_kernel_slim.zip"]
    with_fa3, manifest_fa3 = packed(FA3="1")
    assert with_fa3 == sorted([*without, "sglang_kernel_fa3.zip"]) and manifest_fa3 != manifest


FAKE_PIP = """#!/usr/bin/env bash
# Stands in for `python3 -m pip download ... -d DIR SPEC...`: the kernel wheel is a small zip, the rest nothing.
while (( $# )); do case $1 in -d) dir=$2; shift ;; sglang-kernel==*) kernel=1 ;; esac; shift; done
[[ -n ${kernel:-} ]] || exit 0
python3 -c "import sys, zipfile
with zipfile.ZipFile(sys.argv[1] + '/sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl', 'w') as z:
    for name in ('sgl_kernel/flash_ops.abi3.so', 'sgl_kernel/sm90/common_ops.abi3.so', 'sgl_kernel/sm100/x.so'):
        z.writestr(name, name)" "$dir"
"""


@pytest.mark.skipif(not (shutil.which("zip") and shutil.which("unzip")), reason="zip and unzip are not installed")
def test_a_first_pack_slims_the_kernel_wheel_and_keeps_flashattention3_apart_when_asked(tmp_path):
    """On an empty cache pack fetches the kernel wheel and keeps its sm90 ops (the first pack used to stop with
    "the download failed" after a download that worked); FA3=1 fetches it again for FlashAttention-3 alone."""
    repo, cache = _packing_repo(tmp_path)
    (cache / "bwrap").write_bytes(b"bwrap")
    pip = tmp_path / "fake_python"
    pip.write_text(FAKE_PIP)
    pip.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "FA3"} | {"PYTHON": str(pip)}
    subprocess.run(["bash", "benchmarks/h200_stage.sh", "pack"], cwd=repo, check=True, capture_output=True, env=env)
    with zipfile.ZipFile(cache / "sglang_kernel_slim.zip") as slim:
        assert sorted(slim.namelist()) == ["sgl_kernel/", "sgl_kernel/sm90/", "sgl_kernel/sm90/common_ops.abi3.so"]
    assert not (cache / "sglang_kernel_fa3.zip").exists()
    subprocess.run(["bash", "benchmarks/h200_stage.sh", "pack"], cwd=repo, check=True, capture_output=True,
                   env=env | {"FA3": "1"})
    with zipfile.ZipFile(cache / "sglang_kernel_fa3.zip") as fa3:
        assert fa3.namelist() == ["sgl_kernel/flash_ops.abi3.so"]

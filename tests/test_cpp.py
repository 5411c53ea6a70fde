"""The C++ tests of csrc/ (csrc/tests/, ctest): built standalone with CMakeLists.txt against this torch and run, so
the kernels' C++-side checks (bounds that overflow int64, overlapping destinations, moved or freed storage, the
checksum against its 128-bit definition) run in CI like every other test."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from helpers import REPO


def tool(name: str) -> str:
    """``name`` from this environment's bin (requirements-dev.txt), else from PATH."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} comes with requirements-dev.txt"
    return found


def test_the_csrc_tests_pass(tmp_path):
    build = tmp_path / "build"
    env = os.environ | {"CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    steps = [[tool("cmake"), "-S", str(REPO), "-B", str(build), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}",
              f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DPython3_EXECUTABLE={sys.executable}"],
             [tool("cmake"), "--build", str(build)],
             [tool("ctest"), "--test-dir", str(build), "--output-on-failure"]]
    for step in steps:
        proc = subprocess.run(step, capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, f"{' '.join(step[:2])}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert "100% tests passed, 0 tests failed out of 4" in proc.stdout, proc.stdout

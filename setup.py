"""The one real build of megarl: the package plus its compiled extension megarl._C.

    pip install --no-build-isolation -e .      # torch must already be installed

C++ sources are always built; the CUDA kernels join them when torch sees a GPU (or
MEGARL_FORCE_CUDA=1, for GPU-less build machines) and nvcc is found. DEBUG=1 builds without
optimization and with debug info. TORCH_CUDA_ARCH_LIST defaults to "8.0;9.0" (A100, H100/H200).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import torch
from setuptools import Extension, find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
TORCH_LIB = Path(torch.__file__).resolve().parent / "lib"


def read_version() -> str:
    text = (ROOT / "megarl" / "__init__.py").read_text()
    match = re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE)
    if match is None:
        sys.exit('setup.py: megarl/__init__.py has no __version__ = "..." line')
    return match.group(1)


def sources(cuda: bool) -> list[str]:
    """csrc's .cpp and .cu files; those named *_cuda* need CUDA. csrc/tests belongs to CMake."""
    found = []
    for path in sorted((ROOT / CSRC).rglob("*")):
        rel = path.relative_to(ROOT)
        if path.suffix not in (".cpp", ".cu") or rel.parts[1] == "tests":
            continue
        if cuda or not (path.suffix == ".cu" or "_cuda" in path.stem):
            # Relative paths: setuptools rejects absolute ones in sdists.
            found.append(str(rel))
    return found


def build_cuda() -> bool:
    forced = os.environ.get("MEGARL_FORCE_CUDA") == "1"
    if not (torch.cuda.is_available() or forced):
        return False
    nvcc = Path(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
    if nvcc is not None and nvcc.exists():
        return True
    why = (
        f"torch {torch.__version__} is not a CUDA build"
        if torch.version.cuda is None
        else f"nvcc was not found (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to the CUDA toolkit"
    )
    if forced:
        sys.exit(f"setup.py: MEGARL_FORCE_CUDA=1 but the CUDA kernels cannot be built: {why}")
    print(f"setup.py: building megarl._C without CUDA kernels: {why}", file=sys.stderr)
    return False


def openmp_runtime() -> list[str]:
    # Link the libgomp torch ships (and has already loaded), not the compiler's: two OpenMP
    # runtimes in one process can crash.
    bundled = sorted(TORCH_LIB.glob("libgomp*.so*"))
    return [str(bundled[0])] if bundled else ["-fopenmp"]


def cxx_runtime() -> list[str]:
    # Link the libstdc++ torch runs on. Some toolchains (a GCC under /opt/gcc on our H200 image)
    # link libstdc++ statically by default; _C then carries a private C++ runtime whose locale
    # differs from the process's, and formatting an error message crashed.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if Path(path).name.startswith("libstdc++.so.6"):
            return [path]
    return []


def extension() -> Extension:
    debug = os.environ.get("DEBUG") == "1"
    # No -std here: BuildExtension adds the standard torch's own headers need (C++20 since
    # torch 2.10, C++17 before); csrc itself sticks to C++17.
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # at::parallel_for is inline OpenMP in torch's headers; without -fopenmp it runs on one thread.
    # Hidden visibility, as pybind11 asks, keeps our symbols from clashing with other extensions'.
    cxx += ["-fopenmp", "-fvisibility=hidden"]
    # Without an rpath to torch/lib, `import megarl._C` fails unless torch was imported first.
    link = [*cxx_runtime(), *openmp_runtime(), f"-Wl,-rpath,{TORCH_LIB}"]
    kwargs = {"include_dirs": [str(ROOT / CSRC)], "extra_link_args": link}
    if not build_cuda():
        return CppExtension("megarl._C", sources(cuda=False), extra_compile_args={"cxx": cxx}, **kwargs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    nvcc = (["-O0", "-g", "-lineinfo"] if debug else ["-O3"]) + ["-Xcompiler", "-fvisibility=hidden"]
    return CUDAExtension(
        "megarl._C",
        sources(cuda=True),
        define_macros=[("MEGARL_WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        **kwargs,
    )


setup(
    name="megarl",
    version=read_version(),
    description="RL post-training of LLMs on megatron-core with colocated SGLang/vLLM rollouts",
    packages=find_packages(include=["megarl*"]),
    package_data={"megarl.data": ["gsm8k/*"]},
    python_requires=">=3.11",
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)

"""benchmarks/decode_trace_summary.py: an SGLang decode trace's step time split into GPU work and the host's."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from decode_trace_summary import kernel_family, summarize  # noqa: E402


def _trace() -> dict:
    """Two graph replays 100 us apart; each runs attention (20 us) and a GEMM (10 us) overlapping it by 5 us, and a
    copy of 5 us; a kernel before the first replay (another stage's) is not the steps'."""
    ev = [{"ph": "X", "cat": "kernel", "name": "warmup_kernel", "ts": 0, "dur": 50}]
    for t in (1000, 1100):
        ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 8},
               {"ph": "X", "cat": "kernel", "name": "_fwd_kernel_stage1<128, 2>(float*, int)", "ts": t + 10, "dur": 20},
               {"ph": "X", "cat": "kernel", "name": "sm90_gemm_bf16(params)", "ts": t + 25, "dur": 10},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": t + 40, "dur": 5}]
    return {"traceEvents": ev + [{"ph": "i", "name": "marker", "ts": 1}]}


def test_a_decode_step_is_split_into_gpu_time_and_the_hosts():
    r = summarize(_trace())
    # wall: the first launch (1000) to the last GPU work's end (1100 + 45); busy per step: 10..35 and 40..45 = 30 us
    assert r["steps"] == 2 and r["graphs"]
    assert r["wall_us_per_step"] == (1145 - 1000) / 2
    assert r["gpu_us_per_step"] == 30.0
    assert r["gpu_share"] == round(60 / 145, 3)
    assert r["kernels_per_step"] == 2.0
    assert [(t["kernel"], t["us_per_step"]) for t in r["top"]] == [("_fwd_kernel_stage1", 20.0),
                                                                      ("sm90_gemm_bf16", 10.0)]


def test_kernel_names_lose_their_template_and_argument_lists():
    assert kernel_family("void flash::kernel<Traits<128>, true>(Params)") == "flash::kernel"
    assert kernel_family("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, "
                         "at::native::(anonymous namespace)::Epilogue)") == "at::native::cunn_SoftMaxForward"
    assert kernel_family("void at::native::reduce_kernel<512, 1, Op<a::b<c>, d> >(Op<e>)") == \
        "at::native::reduce_kernel"
    assert kernel_family("triton_poi_fused_add_0") == "triton_poi_fused_add_0"


def test_the_command_reads_a_gzipped_trace(tmp_path):
    path = tmp_path / "x-TP-0-DECODE.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    out = subprocess.run([sys.executable, str(REPO / "benchmarks/decode_trace_summary.py"), str(path), "--json",
                          str(tmp_path / "s.json")], capture_output=True, text=True, check=True).stdout
    assert out.startswith("2 decode steps (CUDA graphs): 72.5 us a step, the GPU busy 30.0 us (41%)")
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 2

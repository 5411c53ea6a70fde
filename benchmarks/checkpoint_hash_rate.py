"""What verifying a checkpoint's manifest costs: checksum rates on this CPU and the time for a model's checkpoint.

  python benchmarks/checkpoint_hash_rate.py [--model llama3-8b] [--ranks 8] [--file-gib 1] [--json OUT]

CRC-32 (megarl.checkpoint.manifest's choice), sha256 and blake2b over the same bytes in memory, one core each; then
megarl.checkpoint.manifest.crc32 of a file just written (read back from the page cache, as a save does) with 1 and 4
threads. The checkpoint of ``--model`` holds bf16 weights (2 bytes a parameter) and the fp32 master weights and
Adam moments (12 bytes a parameter) of the actor (a PPO run: the critic's too, about as much again); a resume's
ranks each verify their share, so the checksum time is size / (ranks x rate) when storage delivers that much.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from argparse import ArgumentParser
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megarl.checkpoint import manifest  # noqa: E402
from megarl.models.presets import preset_or_hf_spec  # noqa: E402


def rate(fn, data: bytes) -> float:
    """GB/s of ``fn`` over ``data``, the best of 3."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def main() -> None:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama3-8b", help="preset (configs/models) or HF directory")
    p.add_argument("--ranks", type=int, default=8, help="ranks that share the verification")
    p.add_argument("--mib", type=int, default=256, help="bytes checksummed in memory")
    p.add_argument("--file-gib", type=float, default=1.0, help="size of the file checksummed from the page cache")
    p.add_argument("--json")
    args = p.parse_args()
    data = os.urandom(args.mib * 2**20)
    result: dict[str, float | str | int] = {
        "crc32_gbps": rate(zlib.crc32, data), "sha256_gbps": rate(lambda b: hashlib.sha256(b).digest(), data),
        "blake2b_gbps": rate(lambda b: hashlib.blake2b(b).digest(), data)}
    with tempfile.TemporaryDirectory() as tmp:
        parts = [Path(tmp) / f"part{i}" for i in range(4)]
        for part in parts:
            with open(part, "wb") as f:
                for _ in range(int(args.file_gib * 1024 / args.mib / 4) or 1):
                    f.write(data)
        size = sum(part.stat().st_size for part in parts)
        start = time.perf_counter()
        for part in parts:
            manifest.crc32(part)
        result["file_crc32_gbps_1_thread"] = size / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        with ThreadPoolExecutor(manifest.THREADS) as pool:
            list(pool.map(manifest.crc32, parts))
        result["file_crc32_gbps_4_threads"] = size / (time.perf_counter() - start) / 1e9
        result["cores"] = os.cpu_count() or 1
    params = preset_or_hf_spec(args.model).num_params()
    gb = params * (2 + 12) / 1e9
    rank_rate = max(float(result["file_crc32_gbps_1_thread"]), float(result["file_crc32_gbps_4_threads"]))
    result |= {"model": args.model, "params_b": params / 1e9, "checkpoint_gb": gb, "ranks": args.ranks,
               "verify_s_one_rank": gb / rank_rate, "verify_s_all_ranks": gb / rank_rate / args.ranks}
    print(f"in memory, one core: CRC-32 {result['crc32_gbps']:.2f} GB/s, sha256 {result['sha256_gbps']:.2f}, "
          f"blake2b {result['blake2b_gbps']:.2f}; a file from the page cache: CRC-32 "
          f"{result['file_crc32_gbps_1_thread']:.2f} GB/s (1 thread), {result['file_crc32_gbps_4_threads']:.2f} "
          f"GB/s ({manifest.THREADS} threads on {result['cores']} cores)")
    print(f"{args.model} ({params / 1e9:.2f} B parameters): a GRPO checkpoint of {gb:.0f} GB (bf16 weights + fp32 "
          f"master weights and Adam moments) checksums in {result['verify_s_one_rank']:.0f} s on one rank at this "
          f"rate, {result['verify_s_all_ranks']:.1f} s over {args.ranks} ranks if storage delivers "
          f"{args.ranks * rank_rate:.0f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

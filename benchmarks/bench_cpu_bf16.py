"""bf16 against float32 on this CPU: one matmul of each, and what `glm_training.environment` detects.

On a CPU with AVX512-BF16 or AMX a bf16 matmul is as fast as float32 or faster; on an AVX2-only CPU it is
emulated, hundreds of times slower. This is the figure behind the warning a bf16 run logs on such a CPU and
behind the tests' choice of float32 for the real-width fixture there. `ONEDNN_MAX_CPU_ISA=AVX2` makes a
bf16-capable CPU take the AVX2 path (oneDNN computes torch's CPU matmuls), so both can be measured on one
machine:

    .venv/bin/python benchmarks/bench_cpu_bf16.py --json bf16.json
    ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python benchmarks/bench_cpu_bf16.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dit import machine_info  # noqa: E402  (also puts the repository root on sys.path)


def time_matmul(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    a @ b  # warm-up (oneDNN builds its kernel on the first call)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=(1024, 4096, 4096), metavar=("M", "K", "N"))
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each dtype (the median is reported)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    m, k, n = args.shape
    result = {"machine": machine_info(torch.device("cpu")), "shape": [m, k, n], "seconds": {}, "gflops": {}}
    for dtype in (torch.float32, torch.bfloat16):
        median = statistics.median(time_matmul(m, k, n, dtype, args.repeats))
        result["seconds"][str(dtype)] = median
        result["gflops"][str(dtype)] = 2 * m * k * n / median / 1e9
    result["bf16_over_fp32"] = result["seconds"]["torch.bfloat16"] / result["seconds"]["torch.float32"]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

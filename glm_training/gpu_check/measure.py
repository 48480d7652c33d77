"""Measuring on a device: timing with synchronisation, peak memory, the environment a run is taken in, the
machine's copy bandwidth and matmul throughput, and the data sheets' dense bf16 peaks that MFU is taken
against."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3
PACKAGES = ("torch", "transformers", "diffusers", "peft", "accelerate")
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (FLOP/s), matched in order against the device name.
SPEC_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, hand the allocator's cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[dict[str, Any]]:
    """Yield a dict that holds, after the block, its `seconds` (device synchronised) and `peak_memory_gib`.

    Peak memory on CUDA: `max_memory_allocated` after `reset_peak_memory_stats`. On the CPU: the process's
    peak RSS (`resource.getrusage`), reset at the start by writing 5 to /proc/self/clear_refs (Linux); where
    that reset is refused, the figure is the peak since the process started and `peak_memory_source` says so.
    """
    out: dict[str, Any] = {"peak_memory_source": "torch.cuda.max_memory_allocated"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            out["peak_memory_source"] = "peak RSS (getrusage, reset per stage)"
        except OSError:
            out["peak_memory_source"] = "peak RSS since process start (getrusage; no reset on this OS)"
    synchronize(device)
    start = time.perf_counter()
    try:
        yield out
    finally:
        synchronize(device)
        out["seconds"] = time.perf_counter() - start
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # ru_maxrss: bytes on macOS, KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
                1 if sys.platform == "darwin" else 1024
            )
        out["peak_memory_gib"] = peak / GIB


@contextlib.contextmanager
def profiled(device: torch.device, path: Path | None) -> Iterator[None]:
    """The block under `torch.profiler` (CPU, and CUDA where it runs), its kernel table written to `path`:
    `key_averages().table`, the 30 rows of most device time (CPU time on a CPU). `path` None: no profiler."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with profile(activities=activities) as prof:
        yield
        synchronize(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70) + "\n")


def compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, driver, CPU model and the package versions the figures were taken with."""
    from glm_training.environment import cpu_has_native_bf16, cpu_model

    info: dict[str, Any] = {
        "device": str(device),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_gib=props.total_memory / GIB,
            cuda_runtime=torch.version.cuda,
            driver_version=_nvidia_driver_version(),
        )
    else:
        info["device_name"] = f"CPU: {info['cpu_model']}"
    return info


def _nvidia_driver_version() -> str | None:
    """From nvidia-smi when it is on PATH (torch does not expose the driver's version)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up: the machine's capability, not its noise
    (another process sharing the CPU only ever slows a call down)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(device: torch.device) -> dict[str, Any]:
    """Memory bandwidth: a copy on the device (1 GiB on CUDA, 256 MiB on the CPU); read + write bytes / s."""
    numel = (GIB if device.type == "cuda" else 256 * 1024**2) // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats=10)
    return {"copy_bytes": numel * 4, "seconds_per_copy": seconds, "bytes_per_s": 2 * numel * 4 / seconds}


def measure_matmul(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Achievable matmul throughput in the compute dtype (8192^3 on CUDA, 1024^3 on the CPU), FLOP/s."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: a @ b, device, repeats=10 if device.type == "cuda" else 3)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "flops_per_s": 2 * n**3 / seconds}


def spec_peak_flops(device_name: str) -> float | None:
    """The data sheet's dense bf16 peak of the named device (`SPEC_BF16_FLOPS`), None when unknown."""
    return next((flops for key, flops in SPEC_BF16_FLOPS if key in device_name), None)

"""What the robustness machinery costs (issue 16): checkpoint hashing, and the per-step agreement.

(1) SHA-256 of a checkpoint file (`checkpoint.file_sha256`, what `hashes.json` records at save and resume
checks) against `torch.save` of the same bytes: the ratio says how much longer a save takes with hashes.
(2) The once-per-step work every rank adds under torchrun: two all-reduces of one flag
(`distributed.collectives.any_rank`, reward failure and stop signal) and six phase records in the rendezvous
store (`distributed.collectives.set_phase`), timed in a 2-process gloo group on this machine.

    .venv/bin/python benchmarks/bench_robustness.py --size-mb 512 --iters 200
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from glm_training.checkpoint import file_sha256
from glm_training.distributed import collectives as dist


def hashing(size_mb: int) -> dict[str, float]:
    tensor = torch.randint(0, 255, (size_mb * 2**20,), dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob.pt"
        start = time.perf_counter()
        torch.save(tensor, path)
        os.sync()
        save_s = time.perf_counter() - start
        start = time.perf_counter()
        file_sha256(path)
        hash_s = time.perf_counter() - start
    return {
        "size_mb": size_mb,
        "save_s": save_s,
        "sha256_s": hash_s,
        "sha256_mb_per_s": size_mb / hash_s,
        "hash_over_save": hash_s / save_s,
    }


def _agreement_worker(rank: int, port: int, iters: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    for _ in range(10):  # warm-up
        dist.any_rank(False)
    tdist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.any_rank(False)
        dist.any_rank(False)
    reduce_s = (time.perf_counter() - start) / iters
    tdist.barrier()
    start = time.perf_counter()
    for step in range(iters):
        for name in ("rollout", "reward gather", "reward gather", "update", "evaluation", "checkpoint"):
            dist.set_phase(name, step)
    phase_s = (time.perf_counter() - start) / iters
    if rank == 0:
        Path(out).write_text(
            json.dumps({"two_all_reduces_ms": reduce_s * 1e3, "six_phase_records_ms": phase_s * 1e3})
        )
    tdist.destroy_process_group()


def agreement(iters: int) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.json")
        mp.spawn(_agreement_worker, args=(port, iters, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", type=str, default="")
    args = parser.parse_args()
    result = {"hashing": hashing(args.size_mb), "per_step_agreement": agreement(args.iters)}
    result["torch"] = torch.__version__
    result["cpus"] = os.cpu_count()
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Each rank's host memory while writing a checkpoint: gathered (rank 0 writes everything) against sharded.

    torchrun --nproc_per_node=2 benchmarks/bench_checkpoint_memory.py [--layers 2] [--json out.json] \
        [key=value ...]

Builds the DiT trainer on the real-width fixture (`model=glm_image_shape`, `--layers` DiT blocks) for a full
fine-tune under FSDP, gives AdamW its state (one step on zero gradients: the state has its real size), then
writes the same checkpoint three times per rank: `trainer.checkpoint_format=sharded`, the same in the
background (`trainer.async_save=true`: the call returns once this rank's part is copied to host memory; the
writing is then waited for), then `gathered`. For each it reports, per rank, the peak resident memory while
writing above the resident memory before (VmHWM, reset through /proc/self/clear_refs), the time the training
is held (for the background write: until the call returns) and the time until the checkpoint is final, and
the size of the trained state (weights and AdamW state) that the rank holds. Figures go in
docs/benchmarks.md with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glm_training import distributed as dist  # noqa: E402
from glm_training.config import load_config  # noqa: E402
from glm_training.environment import cpu_model  # noqa: E402
from glm_training.sharding import local_numel  # noqa: E402
from glm_training.trainers.dit_trainer import DiTTrainer  # noqa: E402

GIB = 1024**3


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="DiT blocks of the real-width fixture")
    parser.add_argument("--json", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    # One folder for every rank (the process group does not exist yet to agree on one).
    out = (
        Path(tempfile.gettempdir()) / f"bench-checkpoint-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    )
    try:
        cfg = load_config(
            config="t2i_training",
            overrides=[
                "model=glm_image_shape",
                f"model.shape_num_dit_layers={args.layers}",
                "model.lora.enabled=false",
                "trainer.strategy=fsdp",
                "trainer.progress_bar=false",
                "eval.every_n_steps=0",
                "logging.tensorboard=false",
                f"trainer.output_dir={out}/run",
                *overrides,
            ],
        )
        trainer = DiTTrainer(cfg)
        params = [p for p in trainer.trainable.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()  # AdamW's state at its real size
        trainer.optimizer.zero_grad(set_to_none=True)
        state_bytes = sum(
            local_numel(p) * p.element_size() * 3 for p in params
        )  # weights + exp_avg + exp_avg_sq held by this rank
        results = {}
        variants = (("sharded", False), ("sharded async", True), ("gathered", False))
        for step, (name, background) in enumerate(variants, start=1):
            # The strategy reads the format when it writes; _save reads async_save.
            trainer.cfg.trainer.checkpoint_format = name.split()[0]
            trainer.cfg.trainer.async_save = background
            dist.barrier()
            before = status_bytes("VmRSS")
            reset_peak()
            start = time.perf_counter()
            trainer._save(step, at_once=not background)
            held = time.perf_counter() - start
            trainer._finish_pending_checkpoint()
            results[name] = {
                "peak_above_before_gib": (status_bytes("VmHWM") - before) / GIB,
                "seconds": held,
                "seconds_until_final": time.perf_counter() - start,
            }
        report = {
            "rank": trainer.rank,
            "world_size": trainer.world_size,
            "layers": args.layers,
            "dtype": cfg.model.dtype,
            "fp32_master_weights": cfg.model.keeps_master_weights(),
            "trained_state_held_gib": state_bytes / GIB,
            **results,
        }
        reports = dist.gather_objects(report)
        if trainer.is_main:
            summary = {"cpu": cpu_model(), "cores": os.cpu_count(), "ranks": reports}
            print(json.dumps(summary, indent=1))
            if args.json:
                args.json.write_text(json.dumps(summary, indent=1))
        dist.barrier()
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()

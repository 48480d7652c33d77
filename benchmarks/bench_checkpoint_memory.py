"""Each rank's host memory while loading and while writing a checkpoint, the previous way against the new.

    torchrun --nproc_per_node=2 benchmarks/bench_checkpoint_memory.py [--layers 2] [--load shards|whole] \
        [--json out.json] [key=value ...]

Builds the DiT trainer on the real-width fixture (`model=glm_image_shape`, `--layers` DiT blocks) for a full
fine-tune of the bfloat16 model (float32 masters, a KL reference) under FSDP, loading the trained component
`--load shards` (built empty, each rank reading its shards from the files: `trainer.fsdp_load_into_shards`) or
`--load whole` (every rank loads the whole pipeline, then shards). Loading: the peak resident memory from
before the trainer is built until it is ready to train, above the resident memory before (VmHWM, reset
through /proc/self/clear_refs), next to what the memory plan predicts (`plan.loading_host_plan`); run it once
per way (each in its own launch: memory freed by one would be reused by the other). Then it gives AdamW its
state (one step on zero gradients: the state has its real size), then
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
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glm_training.config import load_config  # noqa: E402
from glm_training.distributed import collectives as dist  # noqa: E402
from glm_training.engine.trainer import DiTTrainer  # noqa: E402
from glm_training.environment import cpu_model  # noqa: E402
from glm_training.models.placement import local_numel  # noqa: E402
from glm_training.plan import loading_host_plan  # noqa: E402

GIB = 1024**3


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class RssTimeline(logging.Handler):
    """Records (message, VmRSS, VmHWM) at every `[load]` log line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[tuple[str, int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("[load]"):
            self.rows.append((message[:90], status_bytes("VmRSS"), status_bytes("VmHWM")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="DiT blocks of the real-width fixture")
    parser.add_argument("--load", choices=("shards", "whole"), default="shards", help="how the DiT is loaded")
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
                "model.dtype=bfloat16",
                "trainer.mixed_precision=bf16",
                "algo.beta=0.04",
                f"trainer.fsdp_load_into_shards={args.load == 'shards'}",
                "trainer.strategy=fsdp",
                "trainer.progress_bar=false",
                "eval.every_n_steps=0",
                "logging.tensorboard=false",
                f"trainer.output_dir={out}/run",
                *overrides,
            ],
        )
        plan = loading_host_plan(
            cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), device=dist.choose_device().type
        )
        timeline = RssTimeline()
        logging.getLogger("glm_training").addHandler(timeline)
        before_loading = status_bytes("VmRSS")
        reset_peak()
        trainer = DiTTrainer(cfg)
        loading = {
            "way": args.load,
            "peak_above_before_gib": (status_bytes("VmHWM") - before_loading) / GIB,
            "resident_after_gib": (status_bytes("VmRSS") - before_loading) / GIB,
            "planned_peak_gib": plan.peak / GIB,
            "planned": {term.name: term.bytes / GIB for term in plan.terms},
            # Resident and peak memory above the start at each [load] log line: where the peak happens.
            "timeline": [
                (m, (r - before_loading) / GIB, (h - before_loading) / GIB) for m, r, h in timeline.rows
            ],
        }
        logging.getLogger("glm_training").removeHandler(timeline)
        params = [p for p in trainer.policy.trainable.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        trainer.policy.optimizer.step()  # AdamW's state at its real size
        trainer.policy.optimizer.zero_grad(set_to_none=True)
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
            trainer.save(step, at_once=not background)
            held = time.perf_counter() - start
            trainer.checkpoints.finish_pending()
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
            "loading": loading,
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

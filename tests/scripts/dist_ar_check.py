"""Run under `torchrun --nproc_per_node=2` by tests/test_ar_training.py: DAPO dynamic sampling, 2 ranks.

argv: OUT RUNS_JSON. RUNS_JSON maps a run name to its config overrides; the runs go in order, in one process
group. The reward `flat_unless_noisy` scores prompts containing FLAT the same for every sample (zero-std
groups, to be dropped) and the others by JPEG size (spread). Rank r writes `<OUT>/rank<r>.json`: per run, the
first step's collection and update, then whether the whole loop finished (or the collection's error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState

from glm_training.algorithms.grpo.dynamic_sampling import DynamicSamplingExhausted
from glm_training.config import load_config
from glm_training.distributed import collectives as dist
from glm_training.engine.trainer import ARTrainer
from glm_training.rewards import Reward, build_reward, register_reward


@register_reward("flat_unless_noisy")
class FlatUnlessNoisy(Reward):
    def __init__(self):
        self.jpeg = build_reward("jpeg_compressibility")

    def __call__(self, images, prompts, metadata):
        spread = self.jpeg(images, prompts, metadata)
        return torch.tensor([1.0 if "FLAT" in p else float(s) for p, s in zip(prompts, spread)])


def run_one(overrides: list[str]) -> dict:
    """One run: the first step's collection and update looked at closely, then the whole loop."""
    trainer = ARTrainer(load_config(overrides, "ar_training"))
    report: dict = {"rank": trainer.rank}
    try:
        batch = trainer.collect(0)
    except DynamicSamplingExhausted as err:
        return {**report, "error": str(err)}
    records = batch.rollout.records
    tensors = [v for r in records for v in r.values() if isinstance(v, torch.Tensor)]
    stats = trainer.update(batch, 0)
    report.update(
        {
            "stats": batch.stats,
            "num_samples": len(records),
            "tensor_devices": sorted({str(t.device) for t in tensors}),
            "own_device": str(trainer.policy.device),
            "all_on_own_device": all(dist.same_device(t.device, trainer.policy.device) for t in tensors),
            "decisions": trainer.algorithm.last_sampling_decisions,
            "trained_prompts": [p.text for p in batch.prompts],
            "approx_kl": stats.get("approx_kl"),
            "ratio_mean": stats.get("ratio_mean"),
            "skipped": stats.get("skipped", 0.0),
        }
    )
    trainer.train()  # and the whole loop, to completion
    report["finished"] = True
    return report


def main() -> None:
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    reports = {}
    for name, overrides in runs.items():
        AcceleratorState._reset_state()  # accelerate's engine state is per run; the process group stays
        reports[name] = run_one(overrides)
    (out / f"rank{dist.rank_info().rank}.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main()

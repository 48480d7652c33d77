"""Run under `torchrun --nproc_per_node=2` by tests/test_dit_training.py: checks of a real 2-rank DiT trainer.

Writes `<out>/rank<r>.json` with what each rank saw; the test compares the ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from glm_training.config import load_config
from glm_training.distributed import collectives as dist
from glm_training.engine.trainer import DiTTrainer


def main() -> None:
    out = Path(sys.argv[1])
    cfg = load_config(sys.argv[2:], "t2i_training")
    trainer = DiTTrainer(cfg)
    rank = trainer.rank
    own_device = dist.choose_device(trainer.accelerator.local_process_index)
    params = [p for p in trainer.policy.model.parameters() if p.requires_grad]
    batch = trainer.collect(0)
    prior = torch.cat([t.cond.prior_token_ids for t in batch.rollout.trajectories])
    _, group_ids = trainer.collector.step_samples(0)
    stats = trainer.update(batch, 0)
    checksum = sum(float(p.detach().double().sum()) for p in params)
    # The SDE window each rank sampled with at steps 0..2 (a second and third real rollout and update).
    windows = [list(batch.rollout.sde_window)]
    for step in (1, 2):
        later = trainer.collect(step)
        trainer.update(later, step)
        windows.append(list(later.rollout.sde_window))
    report = {
        "rank": rank,
        "world_size": trainer.world_size,
        "wrapped_ddp": isinstance(trainer.policy.model, DistributedDataParallel),
        "plan_distributed": trainer.policy.placement.distributed,
        "plan_load_map": trainer.policy.placement.load_device_map,
        "params_on_own_device": all(dist.same_device(p.device, own_device) for p in params),
        "num_trainable": sum(p.numel() for p in params),
        "group_ids": group_ids,
        "rewards": batch.rewards.tolist(),
        "advantages": batch.advantages.tolist(),
        "prior_tokens": prior.tolist(),
        "approx_kl": stats["approx_kl"],
        "sde_windows": windows,
        "checksum_after_step": checksum,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()

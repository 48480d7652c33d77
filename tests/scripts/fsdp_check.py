"""Run under `torchrun --nproc_per_node=2` by tests/test_fsdp.py: several short runs of one trainer.

argv: OUT KIND RUNS_JSON. KIND is "dit" or "ar"; RUNS_JSON maps a run name to its config overrides (which may
start with `--config-name NAME` for another algorithm's config, whose `algo.name` picks the algorithm, or for
`joint_training`, a joint run of both halves), run in
order (a later run may resume from an earlier one's checkpoint; a name ending in "!error" must be
refused, and its message is reported). Each run writes its own output folder
(the overrides name it); rank r writes `<OUT>/rank<r>.json`: per run, whether the trainable component
was sharded and how many of its trainable elements this rank held.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState
from transformers.distributed.fsdp import is_fsdp_managed_module

from glm_training.build import build_trainer
from glm_training.config import load_config
from glm_training.distributed import collectives as dist
from glm_training.errors import UserError
from glm_training.models.halves import model_half
from glm_training.models.placement import trainable_counts

CONFIGS = {"dit": "t2i_training", "ar": "ar_training"}


def main() -> None:
    # A native abort (SIGABRT, SIGSEGV) prints every thread's Python stack first: the rank's log says where.
    faulthandler.enable(all_threads=True)
    out, kind, runs = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    config = CONFIGS[kind]
    report = {}
    for name, overrides in runs.items():
        # accelerate keeps one engine state per process; each run sets its own precision (the process group,
        # in accelerate's PartialState, stays).
        AcceleratorState._reset_state()
        if name.endswith("!error"):  # a run that must be refused: its message is the report
            try:
                build_trainer(load_config(overrides, config), kind)
            except UserError as err:
                report[name] = {"error": str(err)}
                continue
            raise AssertionError(f"run {name} was not refused")
        cfg = load_config(overrides, config)
        if cfg.component == "joint":  # train_joint.py: both halves, each sharded by its own strategy
            trainer = build_trainer(cfg, "joint")
            trainer.train()
            report[name] = {"sharded": [p.sharded for p in trainer.policies.values()]}
            continue
        trainer = build_trainer(cfg, kind)
        local, total = trainable_counts(trainer.policy.trainable)
        # The dtype the first block's weights have while it runs (FSDP2's policy casts the gathered ones).
        seen = set()
        unit = model_half(kind).shard_units(trainer.policy.trainable)[0]
        hook = unit.register_forward_pre_hook(
            lambda module, args, seen=seen: seen.update(str(p.dtype) for p in module.parameters())
        )
        # The dtype of each floating keyword input the whole component receives (after FSDP2's own hook).
        inputs: dict[str, set] = {}

        def record(module, args, kwargs, inputs=inputs):
            for key, value in kwargs.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    inputs.setdefault(key, set()).add(str(value.dtype))

        input_hook = trainer.policy.trainable.register_forward_pre_hook(record, with_kwargs=True)
        trainer.train()
        hook.remove()
        input_hook.remove()
        report[name] = {
            "sharded": trainer.policy.sharded,
            "local": local,
            "total": total,
            "dtypes": sorted(seen),
            "input_dtypes": {key: sorted(values) for key, values in inputs.items()},
            "synced_generation": is_fsdp_managed_module(trainer.policy.trainable),
            "read_into_shards": trainer.policy.wrapper.trained_folder is not None,
        }
    rank = dist.rank_info().rank
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()

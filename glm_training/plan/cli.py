"""Memory plan: what one rank will hold, computed from the configs before any weight is loaded.

    python -m glm_training.plan --config recipes/flow_grpo_fast_ocr [--world-size 8] [--strategy fsdp] \
        [--gpu-memory-gb 80] [--device cuda|cpu] [config overrides]

Prints the device plan per rank and the host memory while loading; exits 1 when the device plan does not
fit `--gpu-memory-gb`.
"""

from __future__ import annotations

import argparse
import sys

from glm_training.plan.components import meta_components
from glm_training.plan.device import build_plan
from glm_training.plan.joint import joint_plan
from glm_training.plan.loading import loading_host_plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m glm_training.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a training config (configs/t2i_training.yaml, ...)")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default=None, help="default: trainer.strategy")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="per-GPU memory to check against")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where the ranks train (the loading table)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from glm_training.config import load_config

    args, overrides = _parser().parse_known_args(argv)
    cfg = load_config(["--config", args.config, *overrides], args.config)
    device_bytes = (
        int(args.gpu_memory_gb * 1e9 * cfg.model.max_memory_fraction) if args.gpu_memory_gb else None
    )
    modules = meta_components(cfg.model)
    sizes = {"world_size": args.world_size, "strategy": args.strategy, "device_bytes": device_bytes}
    if cfg.component == "joint":  # train_joint.py: both halves train; the AR's loads the pipeline
        plan = joint_plan(cfg.half("ar"), cfg.half("dit"), modules=modules, **sizes)
        cfg = cfg.half("ar")
    else:
        plan = build_plan(cfg, modules=modules, **sizes)
    print(plan.table())
    loading = loading_host_plan(
        cfg, world_size=args.world_size, strategy=args.strategy, device=args.device, modules=modules
    )
    print(loading.table())
    if not plan.fits():
        print(f"does NOT fit: {plan.summary()}", file=sys.stderr)
        return 1
    return 0

"""Memory plan: what one rank will hold, computed from the configs before any weight is loaded.

    python -m glm_training.plan --config recipes/flow_grpo_fast_ocr [--world-size 8] [--strategy fsdp] \
        [--gpu-memory-gb 80] [--device cuda|cpu] [config overrides]

Prints the device plan per rank and the host memory while loading; exits 1 when the device plan does not
fit `--gpu-memory-gb`, 2 with one message (no traceback) on a user error: an unknown config, a key typo.
"""

from __future__ import annotations

import argparse
import sys

from glm_training.errors import report_user_errors
from glm_training.plan.components import meta_components
from glm_training.plan.device import build_plan
from glm_training.plan.joint import joint_plan
from glm_training.plan.loading import loading_host_plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m glm_training.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a training config (configs/t2i_training.yaml, ...)")
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (GPUs)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default=None, help="default: trainer.strategy")
    parser.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="per-GPU memory in GB (10^9 bytes) to check against; the plan may use model.max_memory_fraction "
        "of it, shown in GiB (2^30 bytes) as 'of N GiB usable': 80 GB at 0.9 is 67.06 GiB",
    )
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="where the ranks train (the loading table)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the device and host plans of a config; 0 when it fits, 1 when it does not, 2 on a user error
    (one message naming the fix, no traceback: an unknown config, a key typo)."""
    args, overrides = _parser().parse_known_args(argv)
    fits = True

    def plans() -> str:
        nonlocal fits
        plan, loading = _plans(args, overrides)
        fits = plan.fits()
        if not fits:
            print(f"does NOT fit: {plan.summary()}", file=sys.stderr)
        return f"{plan.table()}\n{loading.table()}"

    return report_user_errors(plans) or (0 if fits else 1)


def _plans(args: argparse.Namespace, overrides: list[str]):
    """(the device plan, the host plan while loading) of the config the command line names."""
    from glm_training.config import load_config

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
    loading = loading_host_plan(
        cfg, world_size=args.world_size, strategy=args.strategy, device=args.device, modules=modules
    )
    return plan, loading

"""The prior cache's command line: `python -m glm_training.priors` (or `torchrun -m`) builds it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from glm_training.priors.build import build_cache


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.priors",
        description="Sample the AR prior tokens of a DiT run's prompts once, for data.prior_cache.",
    )
    parser.add_argument(
        "--config", required=True, help="the DiT training config (e.g. configs/t2i_training.yaml)"
    )
    parser.add_argument("--output", required=True, type=Path, help="the cache folder (never overwritten)")
    parser.add_argument("--num-priors-per-prompt", type=int, default=4, help="sequences per training prompt")
    parser.add_argument(
        "--seed", type=int, default=None, help="base seed of the rows (default: trainer.seed)"
    )
    parser.add_argument("--shard-size", type=int, default=16, help="prompts per shard file (the resume unit)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; config overrides are key=value, e.g. sampling.height=64")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from glm_training.errors import report_user_errors

    def body() -> str:
        from glm_training.config import load_config
        from glm_training.logs import setup_logging

        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        setup_logging(int(os.environ.get("RANK", "0")) == 0)
        cfg = load_config(["--config", args.config, *overrides], args.config)
        out = build_cache(
            cfg,
            args.output,
            num_priors=args.num_priors_per_prompt,
            seed=args.seed,
            shard_size=args.shard_size,
        )
        return f"done: prior cache in {out}"

    return report_user_errors(body)

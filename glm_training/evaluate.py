"""`python -m glm_training.evaluate`: held-out evaluation of a checkpoint (or two: an AR and a DiT run) or of
a config's base model (`evaluation.py` holds the evaluation itself), and with `--benchmark` the
text-rendering benchmarks (`text_benchmarks/`).

    python -m glm_training.evaluate --checkpoint outputs/dit-run [--checkpoint outputs/ar-run] [eval.seed=1]
    python -m glm_training.evaluate --config configs/t2i_training.yaml      # the base model, untrained
    python -m glm_training.evaluate --benchmark cvtg2k --data CVTG-2K --checkpoint outputs/run --output out

Results go to `<output_dir>/eval/<step>.json` and `<step>.png` (`--output` to choose another folder).
"""

from __future__ import annotations

import argparse
import json
import sys

from glm_training.distributed import collectives as dist
from glm_training.evaluation import (
    check_eval_prompts,
    eval_sampling,
    eval_scalars,
    evaluate_prompts,
    evaluated_weights,
    grid_samples,
    load_eval_prompts,
    text_recogniser,
    watched_reward_set,
    write_evaluation,
)
from glm_training.rewards.combine import RewardSet
from glm_training.text_benchmarks.data import BENCHMARKS

BENCHMARK_OPTIONS = ("data", "images", "limit", "ceiling_font")  # refused without --benchmark


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.evaluate",
        description="Evaluate GLM-Image weights on held-out prompts with deterministic sampling.",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="a checkpoint folder (or a run folder: its newest checkpoint); twice for an AR plus a DiT run",
    )
    parser.add_argument(
        "--config", help="evaluate the base model of this training config instead of a checkpoint"
    )
    parser.add_argument(
        "--output", help="folder for <step>.json and <step>.png (default: <run>/eval/standalone)"
    )
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate the EMA weights (default: when the checkpoint has them, as training-time eval does)",
    )
    # Shown in --help; `main` hands a command line with --benchmark to `text_benchmarks.run`, which reads it.
    bench = parser.add_argument_group(
        "text-rendering benchmarks (--benchmark; docs/usage.md)",
        "Generate each prompt's images with --checkpoint / --config weights (or score existing --images) and "
        "score them with the benchmark's official metrics, read by RapidOCR (not the official reader; the "
        "reader's own ceiling on the prompts' rendered text is printed beside the scores); writes "
        "benchmark.json, benchmark.png, images/.",
    )
    bench.add_argument("--benchmark", choices=BENCHMARKS, help="the benchmark: cvtg2k or longtext")
    bench.add_argument("--data", help="the benchmark's released data folder (required with --benchmark)")
    bench.add_argument(
        "--images",
        help="score the images in this folder (the benchmark's layout; X-Omni's for longtext) instead",
    )
    bench.add_argument("--limit", type=int, help="only the first N prompts (default: all)")
    bench.add_argument(
        "--ceiling-font", help="a .ttf/.otf for the reader ceiling's text (default: Pillow's, ASCII only)"
    )
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; config overrides are key=value, e.g. eval.seed=1")
    given = [f"--{k.replace('_', '-')}" for k in BENCHMARK_OPTIONS if getattr(args, k) is not None]
    if given:
        parser.error(
            f"{' '.join(given)}: options of the benchmark mode; add --benchmark {{{','.join(BENCHMARKS)}}}"
        )
    if bool(args.checkpoint) == bool(args.config):
        parser.error("give --checkpoint (trained weights) or --config (the base model), not both or neither")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from glm_training.errors import report_user_errors

    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--benchmark" or a.startswith("--benchmark=") for a in argv):
        from glm_training.text_benchmarks.run import main as benchmark_main

        return benchmark_main(argv)
    return report_user_errors(lambda: _evaluate(*parse_args(argv)))


def _evaluate(args: argparse.Namespace, overrides: list[str]) -> str:
    from glm_training.logs import setup_logging

    setup_logging(True)
    weights = evaluated_weights(args, overrides)
    cfg, step, output = weights.cfg, weights.step, weights.output
    prompts = load_eval_prompts(cfg.eval)
    watched = watched_reward_set(cfg)
    reward_set = RewardSet(cfg.reward.weight_map(), cfg.reward.options, cfg.reward.combine)
    check_eval_prompts(prompts, [reward_set, watched], cfg.eval.text_metrics)
    recogniser = text_recogniser([reward_set, watched]) if cfg.eval.text_metrics else None
    sampling = eval_sampling(cfg)
    pipeline = weights.load()
    device = dist.choose_device(0)
    pipeline.to(device)
    result, images = evaluate_prompts(
        pipeline,
        prompts,
        reward_set,
        sampling,
        device=device,
        watched=watched,
        recogniser=recogniser,
        image_stats=cfg.eval.image_stats,
    )
    reward_set.close()
    if watched is not None:
        watched.close()
    path = write_evaluation(output, step, result, *grid_samples(result, images, cfg.eval.num_grid_images))
    print(json.dumps({"step": step, **eval_scalars(result)}))
    return f"evaluation written to {path}"


if __name__ == "__main__":
    raise SystemExit(main())

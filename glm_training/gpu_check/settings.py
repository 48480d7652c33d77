"""What one check run measures: `Settings`, resolved once from the command line (`parse_settings`, the
`python -m glm_training.gpu_check` flags and their defaults, real and `--toy`), the sections in order of value
and the one prompt every stage uses."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("glm_training.gpu_check")

DESCRIPTION = "One-command check of the GPU path: speed, memory and placement of GLM-Image at its real depth."
PROMPT = 'A red apple on a wooden table, a sign reading "GLM" behind it, soft studio light'
SECTIONS = (
    "seeds",
    "dit",
    "ar",
    "recipes",
    "decoding",
    "pipeline",
)  # in order of value; the environment always runs
PROFILED = ("dit", "ar", "decoding")


def default_recipes() -> tuple[str, ...]:
    """The `recipes` section's rows by default (`gpu_check.recipes`): per algorithm, its recipes on the OCR
    reward, or its first where it has none (the AR half's). Left out: the PickScore variants (the same costs
    with another reward model), GSPO (DAPO's costs with another loss) and the joint run."""
    from glm_training.cli import recipes_by_algorithm

    rows = []
    for algorithm, recipes in recipes_by_algorithm().items():
        if algorithm == "joint":
            continue
        ocr = [r for r in recipes if r.endswith("_ocr")]
        rows += [r.removeprefix("recipes/") for r in (ocr or recipes[:1])]
    return tuple(rows)


@dataclass(frozen=True)
class Settings:
    """What one check run measures, resolved once from the command line."""

    device: torch.device
    dtype: torch.dtype
    toy: bool
    sections: tuple[str, ...]  # SECTIONS to run, in their order
    sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    decoding_paths: tuple[str, ...]  # the AR decoding paths to time (default: every one)
    decode_steps: int
    compile: bool
    num_inference_steps: int
    train_size: int
    output: Path
    overrides: dict[str, list[str]] = field(default_factory=dict)  # per half: --dit-overrides, --ar-overrides
    profile: tuple[str, ...] = ()  # PROFILED sections run under torch.profiler (--profile)
    packed_attention: bool = False  # the decoding loop's steps attend with ar_attention.PACKED_GQA
    recipes: tuple[str, ...] = ()  # the `recipes` section's rows: recipe names, each with `:key=value`s
    seed: int = 0
    layers: dict[str, int] = field(default_factory=dict)  # ar, vision, dit, glyph


def _parser() -> argparse.ArgumentParser:
    """The command line of `python -m glm_training.gpu_check`; the defaults left None are resolved by
    `parse_settings`."""
    from glm_training.pipeline.ar import DECODING_PATHS

    parser = argparse.ArgumentParser(prog="python -m glm_training.gpu_check", description=DESCRIPTION)
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), help="where to run (default: cuda when present, else cpu)")
    add("--toy", action="store_true", help="one layer per stack, 64x64, batches 1 and 2: runs on a CPU")
    add(
        "--output",
        type=Path,
        default=Path("outputs/gpu_check"),
        help="folder for gpu_check.jsonl, gpu_check.json and gpu_check.md (default: outputs/gpu_check)",
    )
    add(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        help=f"what to run, always in this order (default: every one, {' '.join(SECTIONS)})",
    )
    add("--sizes", type=int, nargs="+", help="text-to-image sizes (default 1024; --toy: 64)")
    add("--batch-sizes", type=int, nargs="+", help="AR decoding batch sizes (default 1 16; --toy: 1 2)")
    add(
        "--decoding",
        nargs="+",
        choices=DECODING_PATHS,
        help=f"AR decoding paths to time (default: every one, {' '.join(DECODING_PATHS)})",
    )
    add("--decode-steps", type=int, help="decoding steps timed per path and batch (default 128; --toy: 8)")
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="also time the loop's compiled step, and use it for the text-to-image call (default: on CUDA)",
    )
    add(
        "--packed-attention",
        action="store_true",
        help="time the decoding loop with its per-token steps attending by ar_attention.PACKED_GQA (the "
        "folded sampler's attention: the key/value heads not repeated)",
    )
    add("--num-inference-steps", type=int, help="DiT steps of the text-to-image call (default 50; --toy: 2)")
    add("--train-size", type=int, help="image size of the training steps (default 1024; --toy: 64)")
    add(
        "--profile",
        nargs="+",
        choices=PROFILED,
        default=[],
        help="run these under torch.profiler and write its kernel table as profile_<section>.txt: the "
        "training step (dit, ar), or one more warm call of the compiled decoding loop at the largest batch "
        "(decoding)",
    )
    add(
        "--recipes",
        nargs="+",
        metavar="NAME[:KEY=VALUE...]",
        help="the recipes section's rows: recipes of configs/recipes/, each optionally with config overrides "
        "after colons (default: each algorithm's OCR recipes, or its first: settings.default_recipes)",
    )
    for half in ("dit", "ar"):
        add(
            f"--{half}-overrides",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help=f"config overrides of the {half} training step, after the check's own "
            + ("(e.g. sampling.compile=true)" if half == "ar" else "(e.g. sampling.micro_batch_size=1)"),
        )
    return parser


def _device(parser: argparse.ArgumentParser, name: str | None) -> torch.device:
    """`--device`, or CUDA when torch sees it; a CUDA device is the current one, by index."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no CUDA device; on a CPU run --device cpu --toy.")
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def parse_settings(argv: list[str] | None) -> Settings:
    """The settings of `argv` (None: the process's arguments); bad values exit through argparse's error."""
    from glm_training.environment import cpu_has_native_bf16
    from glm_training.models import shape
    from glm_training.pipeline.ar import DECODING_PATHS

    parser = _parser()
    args = parser.parse_args(argv)
    device = _device(parser, args.device)
    sizes = tuple(args.sizes or ((64,) if args.toy else (1024,)))
    train_size = args.train_size or (64 if args.toy else 1024)
    if any(size % 32 for size in (*sizes, train_size)):
        parser.error(f"sizes must be multiples of 32 (GLM-Image's token grid), got {sizes} and {train_size}.")
    decode_steps = args.decode_steps or (8 if args.toy else 128)
    if decode_steps < 2:
        parser.error(
            f"--decode-steps must be at least 2 (one step beyond the prefill's draw), got {decode_steps}."
        )
    if device.type == "cpu" and not args.toy:
        logger.warning("[gpu_check] the real depth on the CPU needs ~40 GB of RAM and hours; add --toy.")
    real = dict(
        ar=shape.REAL_NUM_AR_LAYERS,
        vision=shape.REAL_NUM_VISION_LAYERS,
        dit=shape.REAL_NUM_DIT_LAYERS,
        glyph=shape.REAL_NUM_GLYPH_LAYERS,
    )
    return Settings(
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32,
        toy=args.toy,
        sections=tuple(name for name in SECTIONS if name in (args.sections or SECTIONS)),
        sizes=sizes,
        batch_sizes=tuple(args.batch_sizes or ((1, 2) if args.toy else (1, 16))),
        decoding_paths=tuple(args.decoding or DECODING_PATHS),
        decode_steps=decode_steps,
        compile=device.type == "cuda" if args.compile is None else args.compile,
        num_inference_steps=args.num_inference_steps or (2 if args.toy else 50),
        train_size=train_size,
        overrides={"dit": args.dit_overrides, "ar": args.ar_overrides},
        profile=tuple(args.profile),
        packed_attention=args.packed_attention,
        recipes=tuple(args.recipes or default_recipes()),
        output=args.output,
        layers={name: 1 for name in real} if args.toy else real,
    )

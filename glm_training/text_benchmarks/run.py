"""`python -m glm_training.evaluate --benchmark cvtg2k|longtext --data DIR --output OUT ...`.

The data folder is read and checked first (`data.py`), before any model loads. Then, with `--checkpoint`
(a run's trained weights, its EMA as the training-time evaluation takes them) or `--config` (that config's
base model; `model.name=PATH` for an export), each prompt's images are generated deterministically (the
evaluation's sampling: seeds from `eval.seed`, the repeat number and the prompt text, so any number of ranks
draws the same images) into `OUT/images/` in the benchmark's own layout; with `--images DIR`, the images
already there are scored instead. Every image's text is read with RapidOCR (`rewards/ocr.py`, fragments
below confidence 0.5 dropped), CVTG-2K's CLIPScore is computed with `reward.options.clip_score.model` (or the
clip_score reward's default) when those weights can be had, and `OUT/benchmark.json` gets the metrics overall
and per subset (`metrics.py`), with `OUT/benchmark.png`, a grid of the first images with what was read under
each. Under `torchrun` the ranks share the prompts and gather the records.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from PIL import Image

from glm_training.distributed import collectives as dist
from glm_training.image_grid import caption, make_image_grid
from glm_training.text_benchmarks.data import BENCHMARKS, BenchmarkDataError, BenchmarkPrompt, load_benchmark
from glm_training.text_benchmarks.metrics import (
    CLIP_PREFIX,
    cvtg_scores,
    cvtg_words,
    longtext_counts,
    summarise,
)

logger = logging.getLogger("glm_training")

REPEATS = {"cvtg2k": 1, "longtext": 4}  # images per prompt, as the official scripts expect
OCR_MIN_CONFIDENCE = 0.5  # PaddleOCR's drop_score in the CVTG-2K script
GRID_IMAGES = 16


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.evaluate --benchmark",
        description="Score GLM-Image weights (or a folder of images) on CVTG-2K or LongText-Bench.",
    )
    parser.add_argument("--benchmark", required=True, choices=BENCHMARKS)
    parser.add_argument("--data", required=True, help="the benchmark's released data folder")
    parser.add_argument("--output", required=True, help="folder for benchmark.json, benchmark.png, images/")
    parser.add_argument("--checkpoint", action="append", default=[], help="as without --benchmark")
    parser.add_argument("--config", help="the base model of this training config")
    parser.add_argument("--images", help="score the images in this folder (the benchmark's layout) instead")
    parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; config overrides are key=value, e.g. eval.seed=1")
    if args.images and (args.checkpoint or args.config):
        parser.error("--images scores existing images: give it without --checkpoint / --config")
    if not args.images and bool(args.checkpoint) == bool(args.config):
        parser.error("give --checkpoint (trained weights), --config (the base model) or --images")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from glm_training.errors import report_user_errors

    return report_user_errors(lambda: run(*parse_args(sys.argv[1:] if argv is None else argv)))


def image_paths(prompts: list[BenchmarkPrompt], benchmark: str, folder: Path) -> list[tuple[int, int, Path]]:
    """(prompt index, repeat, path) of every image the benchmark scores."""
    repeats = REPEATS[benchmark]
    suffix = (lambda k: "") if repeats == 1 else (lambda k: f"_{k}")
    return [
        (i, k, folder / f"{p.image_name}{suffix(k)}.png")
        for i, p in enumerate(prompts)
        for k in range(repeats)
    ]


def run(args: argparse.Namespace, overrides: list[str]) -> str:
    from glm_training.logs import setup_logging

    started = _start_ranks()
    setup_logging(dist.rank_info().rank == 0)
    prompts = load_benchmark(args.benchmark, args.data)[: args.limit or None]
    output = Path(args.output)
    items = image_paths(prompts, args.benchmark, Path(args.images) if args.images else output / "images")
    rank, world = dist.rank_info().rank, dist.rank_info().world_size
    mine = items[rank::world]
    if args.images:
        missing = [str(path) for _, _, path in items if not path.is_file()]
        if missing:
            raise BenchmarkDataError(
                f"--images {args.images}: {len(missing)} of {len(items)} images missing, e.g. {missing[0]}; "
                f"expected the {args.benchmark} layout (python -m glm_training.evaluate --benchmark "
                f"{args.benchmark} --checkpoint RUN writes it under OUTPUT/images)."
            )
        cfg = None
    else:
        cfg = _generate(args, overrides, prompts, mine)
    dist.barrier()
    records = _score(args.benchmark, prompts, mine, cfg)
    everyone = sorted(dist.flatten(dist.gather_objects(records)), key=lambda r: r["image"])
    result = {"benchmark": args.benchmark, "data": str(args.data), **summarise(args.benchmark, everyone)}
    result["ocr"] = (
        "RapidOCR (PaddleOCR's PP-OCR models in onnxruntime), fragments below confidence 0.5 dropped"
    )
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "benchmark.json").write_text(json.dumps({**result, "images": everyone}, indent=2), "utf-8")
        shown = everyone[:GRID_IMAGES]
        grid = [Image.open(Path(r["path"])).convert("RGB") for r in shown]
        make_image_grid(grid, [caption(f"read: {r['recognised'] or '(nothing)'}", None) for r in shown]).save(
            output / "benchmark.png"
        )
    if started:
        dist.barrier()
        import torch.distributed

        torch.distributed.destroy_process_group()
    if rank != 0:
        return ""  # rank 0 reports for every rank
    summary = {k: v for k, v in result.items() if k not in ("per_subset", "images")}
    return f"{json.dumps(summary)}\nbenchmark written to {output / 'benchmark.json'}"


def _start_ranks() -> bool:
    """Join the process group torchrun describes (gloo on CPUs, NCCL on GPUs); False when alone."""
    import torch
    import torch.distributed

    if dist.rank_info().world_size == 1 or torch.distributed.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    return True


def _generate(args, overrides, prompts: list[BenchmarkPrompt], mine: list[tuple[int, int, Path]]) -> Any:
    """This rank's images, drawn as the evaluation draws them (seed `eval.seed` + the repeat number)."""
    from glm_training.evaluation import eval_sampling, evaluated_weights, sample_batch

    weights = evaluated_weights(args, overrides)
    sampling = eval_sampling(weights.cfg)
    pipeline = weights.load()
    device = dist.choose_device(dist.rank_info().local_rank)
    pipeline.to(device)
    progress = Progress("generated", len(mine))
    for start in range(0, len(mine), sampling.batch_size):
        batch = mine[start : start + sampling.batch_size]
        progress.update(start)
        for repeat in sorted({k for _, k, _ in batch}):
            same = [(i, path) for i, k, path in batch if k == repeat]
            texts = [prompts[i].prompt for i, _ in same]
            images = sample_batch(pipeline, texts, replace(sampling, seed=sampling.seed + repeat), device)
            for (_, path), image in zip(same, images):
                path.parent.mkdir(parents=True, exist_ok=True)
                image.save(path)
    progress.update(len(mine))
    return weights.cfg


def _score(benchmark: str, prompts: list[BenchmarkPrompt], mine, cfg: Any) -> list[dict]:
    from glm_training.rewards.ocr import OcrReward

    reader = OcrReward(min_confidence=OCR_MIN_CONFIDENCE)
    clip = _clip_score(cfg) if benchmark == "cvtg2k" else None
    records = []
    progress = Progress("scored", len(mine))
    for i, repeat, path in mine:
        progress.update(len(records))
        prompt = prompts[i]
        image = Image.open(path).convert("RGB")
        recognised = reader.recognise(image)
        record = {"image": f"{prompt.image_name}/{repeat}", "path": str(path), "subset": prompt.subset}
        record["recognised"] = recognised
        if benchmark == "cvtg2k":
            total, correct, neds = cvtg_scores(cvtg_words(prompt.prompt), recognised)
            score = None if clip is None else float(clip([image], [prompt.prompt], [{}])[0])
            record.update(total=total, correct=correct, neds=neds, clip_score=score)
        else:
            matched, total = longtext_counts(prompt.text, recognised, prompt.language)
            record.update(matched=matched, total=total)
        records.append(record)
    progress.update(len(records))
    return records


class Progress:
    """This rank's progress through its images, logged about every 5 % (the real LongText set is 1,280
    images at 1024²)."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.next = what, total, 0

    def update(self, done: int) -> None:
        if done >= self.next and self.total:
            logger.info("[benchmark] %s %d of %d images on this rank", self.what, done, self.total)
            self.next = done + max(1, self.total // 20) if done < self.total else math.inf


def _clip_score(cfg: Any) -> Any:
    """CVTG-2K's CLIPScore, 2.5 max(cos, 0) with "A photo depicts " + prompt; None (logged) when the CLIP
    weights cannot be had (offline, not in the cache)."""
    from glm_training.rewards.clip_score import CLIPSCORE_MODEL, ClipScoreReward

    options = dict(cfg.reward.options.get("clip_score", {})) if cfg is not None else {}
    model = options.get("model", CLIPSCORE_MODEL)
    try:
        return ClipScoreReward(model=model, device=options.get("device", "auto"), prefix=CLIP_PREFIX, w=2.5)
    except (OSError, ValueError) as err:
        logger.warning(
            "clip_score is null: the CLIP weights %s cannot be had here (%s); give a local copy with "
            "reward.options.clip_score.model=PATH (the official script uses OpenAI's ViT-L/14)",
            model,
            str(err).splitlines()[0] if str(err) else type(err).__name__,
        )
        return None

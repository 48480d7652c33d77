"""`python -m glm_training.evaluate --benchmark cvtg2k|longtext --data DIR --output OUT ...`.

The data folder is read and checked first (`data.py`), before any model loads. Then, with `--checkpoint`
(a run's trained weights, its EMA as the training-time evaluation takes them) or `--config` (that config's
base model; `model.name=PATH` for an export), each prompt's images are generated deterministically (the
evaluation's sampling: seeds from `eval.seed`, the repeat number and the prompt text, so any number of ranks
draws the same images) into `OUT/images/` in the benchmark's own layout (`layout.py`); with `--images DIR`,
the images already there are scored instead. Every image's text is read with RapidOCR (`rewards/ocr.py`,
fragments below confidence 0.5 dropped), CVTG-2K's CLIPScore is computed with
`reward.options.clip_score.model` (or the clip_score reward's default) when those weights can be had, and
`OUT/benchmark.json` gets the metrics overall and per subset (`metrics.py`), the reader's ceiling on the same
prompts (`ceiling.py`), the published table with each cell's counts (`table.py`), and every image's record,
with `OUT/benchmark.png`, a grid of the first images with what was read under each. The table is printed.
Under `torchrun` the ranks share the prompts and gather the records.

Official: the metric formulas. Not official: the reader. CVTG-2K's script reads with PaddleOCR 2.10's English
models and LongText-Bench's with Qwen2.5-VL-7B-Instruct (`OFFICIAL_READERS`); RapidOCR here reads differently,
and `reader_ceiling` says by how much on perfect images.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from PIL import Image

from glm_training.distributed import collectives as dist
from glm_training.image_grid import caption, make_image_grid
from glm_training.text_benchmarks.ceiling import ceiling_records, font_name, load_font
from glm_training.text_benchmarks.data import BENCHMARKS, BenchmarkPrompt, load_benchmark
from glm_training.text_benchmarks.layout import existing_images, image_paths
from glm_training.text_benchmarks.metrics import CLIP_PREFIX, score_text, summarise
from glm_training.text_benchmarks.table import format_table, published_row

logger = logging.getLogger("glm_training")

OCR_MIN_CONFIDENCE = 0.5  # PaddleOCR's drop_score in the CVTG-2K script
GRID_IMAGES = 16
OFFICIAL_READERS = {
    "cvtg2k": "PaddleOCR 2.10, lang='en' (English PP-OCRv3 detection, English PP-OCRv4 recognition), angle "
    "classifier on, lines below confidence 0.5 dropped (TextCrafter's unified_metrics_eval.py)",
    "longtext": "Qwen2.5-VL-7B-Instruct asked for the image's text (X-Omni's textbench)",
}


def reader_description() -> str:
    return (
        f"RapidOCR {metadata.version('rapidocr-onnxruntime')} (PaddleOCR's Chinese-English PP-OCRv4 mobile "
        "models in onnxruntime), no angle classifier, fragments below confidence 0.5 dropped; not the "
        "official reader"
    )


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
    parser.add_argument(
        "--images",
        help="score the images in this folder (the benchmark's layout; X-Omni's for longtext) instead",
    )
    parser.add_argument("--ema", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--limit", type=int, default=0, help="only the first N prompts (0 = all)")
    parser.add_argument(
        "--ceiling-font", help="font for the reader ceiling's rendered text (default: Pillow's, ASCII only)"
    )
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


def run(args: argparse.Namespace, overrides: list[str]) -> str:
    from glm_training.logs import setup_logging
    from glm_training.rewards.ocr import OcrReward

    started = _start_ranks()
    setup_logging(dist.rank_info().rank == 0)
    prompts = load_benchmark(args.benchmark, args.data)[: args.limit or None]
    font = load_font(args.ceiling_font)  # a bad font path stops here, before any model loads
    output = Path(args.output)
    rank, world = dist.rank_info().rank, dist.rank_info().world_size
    if args.images:
        items = existing_images(prompts, args.benchmark, Path(args.images))
        cfg = None
    else:
        items = image_paths(prompts, args.benchmark, output / "images")
        cfg = _generate(args, overrides, prompts, items[rank::world])
    dist.barrier()
    read = OcrReward(min_confidence=OCR_MIN_CONFIDENCE).recognise
    records = _score(args.benchmark, prompts, items[rank::world], read, cfg)
    ceiling, skipped = _ceiling(args.benchmark, prompts[rank::world], read, font)
    gathered = dist.gather_objects((records, ceiling, skipped))
    records, ceiling, skipped = (dist.flatten(part) for part in zip(*gathered))  # every rank's, each
    records.sort(key=lambda r: r["image"])
    ceiling.sort(key=lambda r: r["image"])
    skipped.sort()
    font_label = font_name(font) + (
        f" ({args.ceiling_font})" if args.ceiling_font else " (Pillow's built-in)"
    )
    result = _result(args.benchmark, args.data, records, ceiling, skipped, font_label)
    if rank == 0:
        if skipped:
            logger.warning(
                "reader ceiling: %d of %d prompts skipped (e.g. %s), the font %s has no glyph for some of "
                "their characters; give --ceiling-font PATH, a font with them (e.g. Noto Sans CJK for ZH)",
                len(skipped),
                len(prompts),
                skipped[0],
                font_label,
            )
        _write(output, result, records, ceiling)
    if started:
        dist.barrier()
        import torch.distributed

        torch.distributed.destroy_process_group()
    if rank != 0:
        return ""  # rank 0 reports for every rank
    return _report(args.benchmark, result, output)


def _ceiling(
    benchmark: str, mine: list[BenchmarkPrompt], read: Callable[[Image.Image], str], font: Any
) -> tuple[list[dict], list[str]]:
    """`ceiling.ceiling_records` of this rank's prompts, in twentieths to log the progress."""
    records, skipped = [], []
    progress = Progress("reader ceiling: rendered and read", len(mine), "prompts")
    step = max(1, len(mine) // 20)
    for start in range(0, len(mine), step):
        progress.update(start)
        done, passed = ceiling_records(benchmark, mine[start : start + step], read, font)
        records += done
        skipped += passed
    progress.update(len(mine))
    return records, skipped


def _result(
    benchmark: str,
    data: str,
    records: list[dict],
    ceiling: list[dict],
    skipped: list[str],
    font_label: str,
) -> dict:
    """`benchmark.json` but the records: the model's numbers, the reader's, its ceiling, the table."""
    result = {"benchmark": benchmark, "data": str(data), **summarise(benchmark, records)}
    result["ocr"] = reader_description()
    result["official_reader"] = OFFICIAL_READERS[benchmark]
    result["reader_ceiling"] = {
        "font": font_label,
        "num_prompts_skipped": len(skipped),  # characters the font has no glyph for
        **summarise(benchmark, ceiling),
    }
    rows = {"model": result, "reader_ceiling": result["reader_ceiling"]}
    result["table"] = {name: published_row(benchmark, row) for name, row in rows.items()}
    return result


def _write(output: Path, result: dict, records: list[dict], ceiling: list[dict]) -> None:
    output.mkdir(parents=True, exist_ok=True)
    saved = {**result, "reader_ceiling": {**result["reader_ceiling"], "images": ceiling}, "images": records}
    (output / "benchmark.json").write_text(json.dumps(saved, indent=2), "utf-8")
    shown = records[:GRID_IMAGES]
    grid = [Image.open(Path(r["path"])).convert("RGB") for r in shown]
    make_image_grid(grid, [caption(f"read: {r['recognised'] or '(nothing)'}", None) for r in shown]).save(
        output / "benchmark.png"
    )


def _report(benchmark: str, result: dict, output: Path) -> str:
    """The printed result: the published table (the model's row, the reader ceiling's), the readers, the
    headline numbers as one JSON line."""
    ceiling = result["reader_ceiling"]
    note = f"the prompts' own text rendered in {ceiling['font']}, read and scored the same way"
    if ceiling["num_prompts_skipped"]:
        note += f"; {ceiling['num_prompts_skipped']} prompts skipped (characters without a glyph)"
    headline = ("per_subset", "images", "table", "reader_ceiling", "ocr", "official_reader")
    return "\n".join(
        [
            format_table(benchmark, {name.replace("_", " "): row for name, row in result["table"].items()}),
            f"model: read with {result['ocr']} (official: {result['official_reader']})",
            f"reader ceiling: {note}",
            json.dumps({k: v for k, v in result.items() if k not in headline}),
            f"benchmark written to {output / 'benchmark.json'}",
        ]
    )


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


def _score(
    benchmark: str, prompts: list[BenchmarkPrompt], mine, read: Callable[[Image.Image], str], cfg: Any
) -> list[dict]:
    clip = _clip_score(cfg) if benchmark == "cvtg2k" else None
    records = []
    progress = Progress("scored", len(mine))
    for i, repeat, path in mine:
        progress.update(len(records))
        prompt = prompts[i]
        image = Image.open(path).convert("RGB")
        recognised = read(image)
        record = {"image": f"{prompt.image_name}/{repeat}", "path": str(path), "subset": prompt.subset}
        record["recognised"] = recognised
        record.update(score_text(benchmark, prompt, recognised))
        if benchmark == "cvtg2k":
            record["clip_score"] = None if clip is None else float(clip([image], [prompt.prompt], [{}])[0])
        records.append(record)
    progress.update(len(records))
    return records


class Progress:
    """This rank's progress through its images (or prompts), logged about every 5 % (the real LongText set
    is 1,280 images at 1024²)."""

    def __init__(self, what: str, total: int, unit: str = "images"):
        self.what, self.total, self.unit, self.next = what, total, unit, 0

    def update(self, done: int) -> None:
        if done >= self.next and self.total:
            logger.info("[benchmark] %s %d of %d %s on this rank", self.what, done, self.total, self.unit)
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

"""The trainer's AR rollout against the bare decoding loop (issue 45, item 5). A script to run, not a test.

    HF_HUB_OFFLINE=1 python benchmarks/bench_ar_sampler.py                 # tiny model, 256x256, CPU
    python benchmarks/bench_ar_sampler.py --height 64 --width 64 --batch 4 --repeats 5 --json out.json

Per decoding step (a rollout's seconds over the tokens it draws, medians of `--repeats` alternated rounds
after one warm-up), on the tiny model with LoRA (rank 4, B drawn non-zero: a trained adapter) on the AR
model's attention projections:

- `bare`: `sample_image_tokens` by the project's decoding loop on the same model without adapters (a second
  copy loaded from the same folder): the loop's own speed, the reference;
- `trainer, sampling.sampler=X`: what `train_ar.py` runs, `GRPO.sample_tokens` of an `ARTrainer`
  (LoRA, `trainer.mixed_precision=no`): the policy module (`policy`), or the folded sampler (`folded`:
  adapters folded into a sampling copy before every rollout, packed grouped-query attention).

Target: the folded trainer's rollout / bare <= 1.15. With B zeroed, the folded weights equal the base weights
bit for bit, so the folded sampler and the bare loop draw the same tokens where their kernels agree
(`same tokens`, checked once; packed attention reorders reductions, which can change a draw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit import machine_info  # noqa: E402  (also puts the repository root on sys.path)

from glm_training.config import load_config  # noqa: E402
from glm_training.data import Prompt  # noqa: E402
from glm_training.engine.trainer import ARTrainer  # noqa: E402
from glm_training.models.wrapper import resolve_model_path  # noqa: E402
from glm_training.pipeline.ar import sample_image_tokens  # noqa: E402

TARGET = 1.15
PROMPTS = ["a red cube on a table", "a lighthouse at dusk", "a bowl of ramen", "a snowy mountain village"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="samples per rollout (prompts cycled)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures here")
    return parser.parse_args(argv)


def trainer(sampler: str, args: argparse.Namespace, output: Path) -> ARTrainer:
    overrides = [
        "model.lora.enabled=true",
        "model.lora.rank=4",
        f"sampling.sampler={sampler}",
        f"sampling.height={args.height}",
        f"sampling.width={args.width}",
        "trainer.progress_bar=false",
        "eval.every_n_steps=0",
        f"trainer.output_dir={output}",
    ]
    built = ARTrainer(load_config(overrides, "ar_training"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in built.policy.trainable.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return built


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    prompts, group_ids = [Prompt(t) for t in PROMPTS], [i % len(PROMPTS) for i in range(args.batch)]
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_ar_sampler"
    trainers = {name: trainer(name, args, scratch / name) for name in ("policy", "folded")}
    from diffusers import GlmImagePipeline

    m = trainers["policy"].cfg.model
    bare_pipe = GlmImagePipeline.from_pretrained(resolve_model_path(m.name, m.tiny_seed, m.shape_layers()))
    params = trainers["folded"].algorithm.sampling_params

    def bare(seed: int):
        return sample_image_tokens(bare_pipe, texts, args.height, args.width, params, seed=seed)

    def by_trainer(name: str):
        return lambda seed: trainers[name].algorithm.sample_tokens(prompts, group_ids, step=seed)

    paths = {"bare": bare, "trainer, sampling.sampler=policy": by_trainer("policy")}
    paths["trainer, sampling.sampler=folded"] = by_trainer("folded")
    tokens = int(bare(0).completion_mask.sum()) + args.batch  # the grids and the extra token, every sample
    for run in paths.values():  # warm-up
        run(0)
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(args.repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run(round_index + 1)
            seconds[name].append(time.perf_counter() - start)
    per_step = {name: 1000 * statistics.median(s) / (tokens / args.batch) for name, s in seconds.items()}
    ratios = {name: per_step[name] / per_step["bare"] for name in per_step}

    # Same tokens: with B zeroed the folded weights are the base weights; the bare loop at the trainer's seed.
    folded = trainers["folded"]
    with torch.no_grad():
        for name, p in folded.policy.trainable.named_parameters():
            if "lora_B" in name:
                p.zero_()
    drawn = folded.algorithm.sample_tokens(prompts, group_ids, step=0)
    seed = folded.collector.sample_seed(0, 0)
    reference = sample_image_tokens(bare_pipe, texts, args.height, args.width, params, seed=seed)
    length = tokens // args.batch
    same = torch.equal(drawn.input_ids[:, -length:], reference.input_ids[:, -length:])

    info = machine_info(torch.device("cpu"))
    size = f"{args.height}x{args.width}"
    report = {
        "machine": info,
        "size": size,
        "batch": args.batch,
        "tokens_per_sample": length,
        "ms_per_step": per_step,
        "ratio_to_bare": ratios,
        "target": TARGET,
        "met": ratios["trainer, sampling.sampler=folded"] <= TARGET,
        "same_tokens_folded_vs_bare_at_zero_B": same,
    }
    print(f"machine: {info}")
    print(f"{size}, batch {args.batch}, {length} tokens a sample, median of {args.repeats}")
    for name in paths:
        print(f"  {name:36s} {per_step[name]:8.2f} ms a step   x{ratios[name]:.3f} of bare")
    print(f"  target: folded <= {TARGET}x bare: {'met' if report['met'] else 'NOT met'}; same tokens: {same}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

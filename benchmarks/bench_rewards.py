"""Benchmark of reward scoring overlapped with the rollout (issue 5). A script to run, not a test.

    HF_HUB_OFFLINE=1 python benchmarks/bench_rewards.py                  # tiny DiT, OCR reward, CPU
    python benchmarks/bench_rewards.py --reward jpeg_compressibility --steps 4 --json out.json

Builds the real `DiTTrainer` (tiny config + overrides) twice, with `reward.overlap=false` and `true`, and
times `collect` (AR prior tokens, the rollout micro-batch by micro-batch, decoding, scoring, advantages) for
`--steps` steps after one warm-up step, alternating the two settings. Checks that both settings give the same
rewards. Overlap pays when the reward is slow relative to a micro-batch of the rollout and the two can run
side by side (a GPU rollout with a CPU or second-GPU scorer; on CPU, a spare core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from bench_dit import machine_info  # noqa: E402  (also puts the repository root on sys.path)

from glm_training.config import load_config  # noqa: E402
from glm_training.engine.trainer import DiTTrainer  # noqa: E402

OCR_PROMPTS = [
    'a shop sign that says "OPEN"',
    'a poster with the word "SALE"',
    'a street sign reading "MAIN ST"',
    'a book cover titled "RIVER"',
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reward", default="ocr")
    p.add_argument("--size", type=int, default=128, help="image height and width")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per setting (after one warm-up)")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def build(args: argparse.Namespace, overlap: bool, folder: Path) -> DiTTrainer:
    prompts = folder / "prompts.txt"
    prompts.write_text("\n".join(OCR_PROMPTS) + "\n")
    overrides = [
        f"reward.names=[{args.reward}]",
        f"reward.overlap={str(overlap).lower()}",
        f"data.prompt_file={prompts}",
        f"sampling.height={args.size}",
        f"sampling.width={args.size}",
        f"sampling.micro_batch_size={args.micro_batch}",
        "data.num_groups_per_step=4",
        "data.num_generations=4",
        "eval.every_n_steps=0",
        "logging.tensorboard=false",
        "trainer.progress_bar=false",
        f"trainer.output_dir={folder / ('overlap' if overlap else 'serial')}",
    ]
    return DiTTrainer(load_config(overrides, "t2i_training"))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {overlap: build(args, overlap, Path(tmp)) for overlap in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        rewards: dict[bool, list[list[float]]] = {False: [], True: []}
        for step in range(args.steps + 1):
            for overlap, trainer in trainers.items():
                start = time.perf_counter()
                batch = trainer.collect(step)
                elapsed = time.perf_counter() - start
                rewards[overlap].append(batch.rewards.tolist())
                if step:  # the first step warms up
                    times[overlap].append(elapsed)
        for trainer in trainers.values():
            trainer.rewards.close()
    serial, overlapped = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "machine": machine_info(trainers[False].device),
        "reward": args.reward,
        "size": args.size,
        "samples_per_step": 16,
        "micro_batch": args.micro_batch,
        "collect_s_serial": round(serial, 3),
        "collect_s_overlap": round(overlapped, 3),
        "speed_up": round(serial / overlapped, 3),
        "same_rewards": rewards[False] == rewards[True],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

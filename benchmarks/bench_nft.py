"""The decoder algorithms on reward per compute: Flow-GRPO, DiffusionNFT, AWM and DGPO (issues 15, 24, 36).
A script to run, not a test.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/bench_nft.py --json out.json
    python benchmarks/bench_nft.py --budgets 20 40 80 --seeds 0 1 --nft optim.lr=1e-2 --algorithms nft awm
    python benchmarks/bench_nft.py --budgets 20 40 80 --seeds 0 1 --lr 3e-2   # one learning rate for all

The trainers start from the same tiny model (the same weights), train on the same prompts with the same
reward, each with its own shipped tiny config (`configs/t2i_training.yaml`, `configs/nft_training.yaml`,
`configs/awm_training.yaml`, `configs/dgpo_training.yaml`, plus the overrides given; `--lr` sets every
one's `optim.lr`). They take training steps in turn, always the one
that has used less CPU time, so the other engineers' load on the machine falls on all alike. The clock is
the CPU time of this process (`time.process_time`, one thread) spent in `collect` + `update`; evaluation
is outside it. Whenever an algorithm's CPU time crosses a budget, its held-out evaluation (the bundled eval
prompts, one fixed seed per prompt, each algorithm's own sampler: Flow-GRPO with CFG 1.5, NFT, AWM and
DGPO CFG-free) is recorded. The figure of merit is the held-out reward gain over the algorithm's own step-0
evaluation, per CPU second, at each budget.

It also measures what the rollout keeps per sample for the update: NFT's, AWM's and DGPO's final latents
and conditioning against Flow-GRPO's trajectory (latents before and after every SDE step, transition
means, log-probs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit import machine_info  # noqa: E402

from glm_training.algorithms.decoder.ode import NFTSamples  # noqa: E402
from glm_training.config import load_config  # noqa: E402
from glm_training.engine.trainer import DiTTrainer  # noqa: E402
from glm_training.logs import setup_logging  # noqa: E402

# Each algorithm: its trainer and shipped tiny config.
ALGORITHMS = {
    "flow_grpo": (DiTTrainer, "t2i_training"),
    "nft": (DiTTrainer, "nft_training"),
    "awm": (DiTTrainer, "awm_training"),
    "dgpo": (DiTTrainer, "dgpo_training"),
}


def wall_clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


CLOCKS = {"process": time.process_time, "wall": wall_clock}
COMMON = ["trainer.progress_bar=false", "logging.tensorboard=false", "eval.every_n_steps=1"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[15, 30, 60, 120], help="CPU seconds")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="trainer.seed of each repetition")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation")
    p.add_argument("--flow-grpo", nargs="*", default=[], help="overrides for configs/t2i_training.yaml")
    p.add_argument("--nft", nargs="*", default=[], help="overrides for configs/nft_training.yaml")
    p.add_argument("--awm", nargs="*", default=[], help="overrides for configs/awm_training.yaml")
    p.add_argument("--dgpo", nargs="*", default=[], help="overrides for configs/dgpo_training.yaml")
    p.add_argument(
        "--lr", type=float, default=None, help="optim.lr of every algorithm (default: each config's)"
    )
    p.add_argument("--algorithms", nargs="+", choices=tuple(ALGORITHMS), default=list(ALGORITHMS))
    p.add_argument(
        "--clock",
        choices=("process", "wall"),
        default="process",
        help="process: CPU time of this process (CPU runs); wall: perf_counter after a device sync (GPU)",
    )
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def rollout_bytes_per_sample(rollout) -> float:
    """Bytes the rollout keeps for `update`, per sample (conditioning included)."""
    total, count = 0, 0
    kept_chunks = rollout.samples if hasattr(rollout, "samples") else rollout.trajectories
    for kept in kept_chunks:
        if isinstance(kept, NFTSamples):
            total += kept.num_bytes()
            count += kept.final_latents.shape[0]
            continue
        cond = [getattr(kept.cond, f) for f in kept.cond.__dataclass_fields__]
        tensors = [
            kept.latents_bsc,
            kept.next_latents_bsc,
            kept.log_probs_bs,
            kept.means_bsc,
            kept.final_latents,
        ]
        total += sum(t.numel() * t.element_size() for t in [*tensors, *cond] if t is not None)
        count += kept.final_latents.shape[0]
    return total / count


class Run:
    """One algorithm's trainer, its CPU clock and its evaluations at the budgets."""

    def __init__(self, name, trainer_cls, config, overrides, seed, budgets, num_eval, out):
        args = [
            *COMMON,
            f"eval.num_prompts={num_eval}",
            f"trainer.seed={seed}",
            f"trainer.num_steps={10**6}",
            f"trainer.output_dir={out / name}",
            *overrides,
        ]
        self.name, self.budgets = name, list(budgets)
        self.trainer = trainer_cls(load_config(args, config))
        self.cpu_s, self.step = 0.0, 0
        self.bytes_per_sample = None
        self.evals = [{"cpu_s": 0.0, "step": 0, "reward": self.evaluate()}]

    def evaluate(self) -> float:
        return self.trainer.evaluate(self.step)["eval/reward_mean"]

    def train_step(self, clock) -> None:
        start = clock()
        batch = self.trainer.collect(self.step)
        self.trainer.update(batch, self.step)
        self.cpu_s += clock() - start
        if self.bytes_per_sample is None:
            self.bytes_per_sample = rollout_bytes_per_sample(batch.rollout)
        self.step += 1
        while self.budgets and self.cpu_s >= self.budgets[0]:
            budget = self.budgets.pop(0)
            self.evals.append(
                {"budget_s": budget, "cpu_s": self.cpu_s, "step": self.step, "reward": self.evaluate()}
            )
            reward = self.evals[-1]["reward"]
            print(f"{self.name}: {budget:g} s -> step {self.step}, eval reward {reward:.4f}", flush=True)


def compare(seed: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            Run(
                name,
                *ALGORITHMS[name],
                [*getattr(args, name), *([f"optim.lr={args.lr}"] if args.lr is not None else [])],
                seed,
                args.budgets,
                args.eval_prompts,
                Path(tmp),
            )
            for name in args.algorithms
        ]
        while any(r.budgets for r in runs):
            min((r for r in runs if r.budgets), key=lambda r: r.cpu_s).train_step(CLOCKS[args.clock])
    result = {}
    for r in runs:
        base = r.evals[0]["reward"]
        result[r.name] = {
            "evals": r.evals,
            "cpu_s_per_step": r.cpu_s / r.step,
            "rollout_bytes_per_sample": r.bytes_per_sample,
            "gain_per_cpu_s": {e["budget_s"]: (e["reward"] - base) / e["cpu_s"] for e in r.evals[1:]},
        }
    # Each algorithm's gain per CPU second over each other's, at every budget (None where the other's is 0).
    for name in args.algorithms:
        for other in args.algorithms:
            if other != name:
                result[f"ratio_{name}_over_{other}"] = {
                    b: result[name]["gain_per_cpu_s"][b] / g if g else None
                    for b, g in result[other]["gain_per_cpu_s"].items()
                }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(False)
    report = {"machine": machine_info(torch.device("cpu")), "settings": vars(args) | {"json": str(args.json)}}
    report["seeds"] = {seed: compare(seed, args) for seed in args.seeds}
    for seed, res in report["seeds"].items():
        print(f"seed {seed}:")
        for name in args.algorithms:
            r = res[name]
            curve = ", ".join(f"{e['cpu_s']:.0f}s/{e['step']}st: {e['reward']:.4f}" for e in r["evals"])
            kept = r["rollout_bytes_per_sample"]
            print(f"  {name}: {r['cpu_s_per_step']:.2f} s/step, {kept:.0f} B/sample kept;")
            print(f"    eval reward vs CPU s: {curve}")
        for key in (k for k in res if k.startswith("ratio_")):
            print(f"  reward gain per CPU s, {key[len('ratio_') :]}:", res[key])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

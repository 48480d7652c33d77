"""Both halves from one rollout against the two-run decoupled recipe: CPU seconds to the same gain on each
half (issue 37). A script to run, not a test.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/bench_joint.py --json out.json
    python benchmarks/bench_joint.py --steps 40 --every 5 --seeds 0 1 [--rewards same]

Both arms start from the same tiny model and use `configs/joint_training.yaml` with the decoupled recipe's
rewards (`examples/decoupled_recipe.sh`): JPEG compressibility for the AR model, incompressibility (detail)
for the DiT; `--rewards same` gives both halves compressibility.

- joint: `JointTrainer`, `--steps` steps.
- decoupled: the AR trainer on the joint config's AR half (`JointTrainConfig.half("ar")`: the same prompts,
  priors per prompt, learning rate, and a render by the frozen DiT with the DiT half's steps), `--steps`
  steps; then the DiT trainer on its DiT half (the same groups of renderings per prior, live priors from the
  trained AR model, `model.ar_weights`), `--steps` steps.

The clock is this process's CPU time (`time.process_time`, one thread) in `collect` + `update`; evaluation is
outside it. Every `--every` steps each trained half is evaluated on the bundled held-out prompts (one fixed
seed per prompt) with the other half at its base weights, so each half's gain is its own: the AR model with
the base DiT under the AR reward, the DiT with the base AR model under the DiT reward. The figure of merit:
for each half's target gain (the smaller of the two arms' best), the CPU seconds at the first evaluation that
reaches it; the decoupled recipe needs its AR stage's time plus its DiT stage's, the joint run the larger of
its two.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from glm_training.config import load_config  # noqa: E402
from glm_training.engine.trainer import ARTrainer, DiTTrainer  # noqa: E402
from glm_training.evaluation import eval_sampling, evaluate_prompts, load_eval_prompts  # noqa: E402
from glm_training.joint.trainer import JointTrainer  # noqa: E402
from glm_training.logs import setup_logging  # noqa: E402
from glm_training.rewards import RewardSet  # noqa: E402

# The decoupled recipe's rewards (opposed: detail for the DiT, compressibility for the AR), or one for both.
REWARDS = {
    "decoupled": ["ar_reward.names=[jpeg_compressibility]", "dit_reward.names=[jpeg_incompressibility]"],
    "same": ["ar_reward.names=[jpeg_compressibility]", "dit_reward.names=[jpeg_compressibility]"],
}
MODULES = {"ar": "vision_language_encoder", "dit": "transformer"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps of each run")
    parser.add_argument("--every", type=int, default=5, help="steps between evaluations")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--rewards", choices=sorted(REWARDS), default="decoupled", help="the halves' rewards (REWARDS)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="joint config overrides (key=value)")
    return parser.parse_args(argv)


@contextlib.contextmanager
def at_base(module: torch.nn.Module, base: dict[str, torch.Tensor]):
    """`module` with its base weights inside (its trained weights restored after)."""
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    module.load_state_dict(base)
    try:
        yield
    finally:
        module.load_state_dict(trained)


class Arm:
    """One trained half's curve: (CPU s, held-out gain of that half, with the other half at its base)."""

    def __init__(self, pipe, cfg, half: str, rewards: RewardSet, bases: dict, prompts: list):
        self.pipe, self.cfg, self.half, self.rewards = pipe, cfg, half, rewards
        self.bases, self.prompts = bases, prompts
        self.points: list[tuple[float, float]] = []
        self.start = None

    def evaluate(self, cpu_s: float) -> None:
        other = "dit" if self.half == "ar" else "ar"
        module = getattr(self.pipe, MODULES[other])
        with torch.no_grad(), torch.random.fork_rng(), at_base(module, self.bases[other]):
            result, _ = evaluate_prompts(
                self.pipe, self.prompts, self.rewards, eval_sampling(self.cfg), device=torch.device("cpu")
            )
        reward = result["reward_mean"]
        self.start = reward if self.start is None else self.start
        self.points.append((cpu_s, reward - self.start))


def base_weights(pipe) -> dict[str, dict[str, torch.Tensor]]:
    return {
        h: {k: v.detach().clone() for k, v in getattr(pipe, m).state_dict().items()}
        for h, m in MODULES.items()
    }


def train(trainer, steps: int, every: int, arms: list[Arm], offset: float = 0.0) -> float:
    """Train `steps` steps, evaluating `arms` every `every` steps; the CPU seconds the steps took."""
    used = 0.0
    for arm in arms:
        arm.evaluate(offset)
    for step in range(steps):
        start = time.process_time()
        trainer.update(trainer.collect(step), step)
        used += time.process_time() - start
        if (step + 1) % every == 0:
            for arm in arms:
                arm.evaluate(offset + used)
    return used


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The CPU seconds of the first evaluation at or above `target`; None for a target that is no gain."""
    if target <= 0:
        return None
    return next((t for t, gain in points if gain >= target), None)


def compare(seed: int, args: argparse.Namespace, out: Path) -> dict:
    overrides = [
        *REWARDS[args.rewards],
        f"trainer.seed={seed}",
        "trainer.progress_bar=false",
        "eval.every_n_steps=0",
    ]
    overrides += [f"trainer.num_steps={args.steps}", "logging.tensorboard=false", *args.overrides]
    cfg = load_config(config="joint_training", overrides=[*overrides, f"trainer.output_dir={out / 'joint'}"])
    prompts = load_eval_prompts(cfg.eval)
    ar_rewards, dit_rewards = (RewardSet({n: 1.0 for n in r.names}) for r in (cfg.ar_reward, cfg.dit_reward))
    joint = JointTrainer(cfg)
    pipe = joint.policies["dit_"].wrapper.pipeline
    bases = base_weights(pipe)
    joint_arms = [
        Arm(pipe, cfg.half("ar"), "ar", ar_rewards, bases, prompts),
        Arm(pipe, cfg.half("dit"), "dit", dit_rewards, bases, prompts),
    ]
    train(joint, args.steps, args.every, joint_arms)

    def moved(half_cfg, name: str, **model):
        t = dataclasses.replace(half_cfg.trainer, output_dir=str(out / name))
        return dataclasses.replace(half_cfg, trainer=t, model=dataclasses.replace(half_cfg.model, **model))

    ar_trainer = ARTrainer(moved(cfg.half("ar"), "ar"))
    ar_arm = Arm(ar_trainer.policy.wrapper.pipeline, cfg.half("ar"), "ar", ar_rewards, bases, prompts)
    ar_seconds = train(ar_trainer, args.steps, args.every, [ar_arm])
    ar_trainer.save(args.steps)
    dit_trainer = DiTTrainer(moved(cfg.half("dit"), "dit", ar_weights=str(out / "ar")))
    dit_arm = Arm(dit_trainer.policy.wrapper.pipeline, cfg.half("dit"), "dit", dit_rewards, bases, prompts)
    dit_seconds = train(dit_trainer, args.steps, args.every, [dit_arm], offset=ar_seconds)
    dit_arm.points = [(t - ar_seconds, g) for t, g in dit_arm.points]  # the DiT stage's own clock

    result = {"seed": seed, "curves": {}}
    for half, joint_arm, stage_arm in (("ar", joint_arms[0], ar_arm), ("dit", joint_arms[1], dit_arm)):
        target = min(max(g for _, g in joint_arm.points), max(g for _, g in stage_arm.points))
        result[half] = {
            "target_gain": target,
            "joint_s": time_to(joint_arm.points, target),
            "decoupled_stage_s": time_to(stage_arm.points, target),
        }
        result["curves"][half] = {"joint": joint_arm.points, "decoupled": stage_arm.points}
    times = [result[h][k] for h in ("ar", "dit") for k in ("joint_s", "decoupled_stage_s")]
    if None in times:  # an arm never gained on some half: no common target
        result["both"] = {"joint_s": None, "decoupled_s": None, "speedup": None}
    else:
        joint_s = max(result[h]["joint_s"] for h in ("ar", "dit"))
        decoupled_s = result["ar"]["decoupled_stage_s"] + result["dit"]["decoupled_stage_s"]
        result["both"] = {"joint_s": joint_s, "decoupled_s": decoupled_s, "speedup": decoupled_s / joint_s}
    result["cpu_s_per_step"] = {
        "joint": joint_arms[0].points[-1][0] / args.steps,
        "decoupled_ar": ar_seconds / args.steps,
        "decoupled_dit": dit_seconds / args.steps,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(False)
    torch.set_num_threads(1)
    report = {"machine": machine_info(torch.device("cpu")), "settings": vars(args) | {"json": str(args.json)}}
    report["runs"] = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            run = compare(seed, args, Path(out))
        report["runs"].append(run)
        both = run["both"]
        if both["speedup"] is None:
            print(f"seed {seed}: an arm never gained on one half; curves: {run['curves']}")
            continue
        print(
            f"seed {seed}: AR target gain {run['ar']['target_gain']:+.3f}, "
            f"DiT {run['dit']['target_gain']:+.3f}; "
            f"joint {both['joint_s']:.1f} CPU s, decoupled {both['decoupled_s']:.1f} "
            f"(AR {run['ar']['decoupled_stage_s']:.1f} + DiT {run['dit']['decoupled_stage_s']:.1f}); "
            f"x{both['speedup']:.2f}; per step {run['cpu_s_per_step']}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

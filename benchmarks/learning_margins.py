"""How much the tests' short runs learn, over seeds: the figures behind every learning assertion's threshold.

Each case is the call a test makes (the default runs of `tests/test_*_training.py`, the decoupled recipe's AR
stage), run once per `trainer.seed` under the tests' pinned numerics (PINNED_NUMERICS in `tests/conftest.py`),
each in its own process, and the figures the test asserts on are printed: training-reward gains (mean of the
last k steps minus the first k) and held-out gains (the evaluation at the last step minus the one before
training). A test's threshold is one the smallest of five seeds clears with room; the five values stand in a
comment beside it.

    python benchmarks/learning_margins.py                      # every case, seeds 0-4
    python benchmarks/learning_margins.py ar joint --seeds 0 1 # some cases, some seeds
    python benchmarks/learning_margins.py --jobs 2             # two runs at a time (one thread each)
    python benchmarks/learning_margins.py ar --set trainer.num_steps=30   # a candidate setting
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import PINNED_NUMERICS  # noqa: E402  (the tests' own pin, not a copy)

PROMPTS = ["a red cube on a table", "a lighthouse at dusk", "a bowl of ramen", "a snowy mountain village"]

# name: (trainer, config, overrides, [(figure, key, k)] where k > 0: last k minus first k steps of `key`,
# k == 0: the last evaluation minus the first of the eval files' reward_mean)
CASES: dict[str, tuple[str, str, list[str], list[tuple[str, str, int]]]] = {
    "dit": ("dit", "t2i_training", [], [("train", "reward_mean", 10), ("eval", "", 0)]),
    "ar": (
        "ar",
        "ar_training",
        ["trainer.num_steps=20", "eval.every_n_steps=10"],
        [("train", "reward_mean", 5), ("eval", "", 0)],
    ),
    "joint": (
        "joint",
        "joint_training",
        [],
        [("ar_train", "ar_reward_mean", 5), ("dit_train", "dit_reward_mean", 5), ("eval", "", 0)],
    ),
    "nft": ("dit", "nft_training", ["trainer.num_steps=20"], [("train", "reward_mean", 5), ("eval", "", 0)]),
    "awm": (
        "dit",
        "awm_training",
        ["trainer.num_steps=16", "eval.every_n_steps=16"],
        [("train", "reward_mean", 4), ("eval", "", 0)],
    ),
    "dgpo": (
        "dit",
        "dgpo_training",
        ["trainer.num_steps=20"],
        [("train", "reward_mean", 5), ("eval", "", 0)],
    ),
    # tests/test_recipe.py: the decoupled recipe's AR stage (examples/decoupled_recipe.sh's first command).
    "recipe_ar": (
        "ar",
        "ar_training",
        [
            "trainer.num_steps=6",
            "eval.every_n_steps=6",
            "reward.names=[jpeg_compressibility]",
            "optim.lr=1e-2",
            "eval.num_prompts=4",
            "data.prompt_file={prompts}",
        ],
        [("eval", "", 0)],
    ),
}

RUNNER = "import sys; from glm_training.cli import run; sys.exit(run(sys.argv[1], sys.argv[2], sys.argv[3:]))"


def figures(out: Path, wanted: list[tuple[str, str, int]]) -> dict[str, float | dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = sorted(
        (int(p.stem), json.loads(p.read_text())["reward_mean"]) for p in (out / "eval").glob("*.json")
    )
    result = {}
    for name, key, k in wanted:
        if k:
            values = [r[key] for r in rows]
            result[name] = sum(values[-k:]) / k - sum(values[:k]) / k
        else:
            result[name] = evals[-1][1] - evals[0][1]
    result["evals"] = {step: round(value, 4) for step, value in evals}
    return result


def measure(case: str, seed: int, extra: list[str]) -> dict[str, float | dict]:
    trainer, config, overrides, wanted = CASES[case]
    keys = {e.split("=", 1)[0] for e in extra}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in keys] + extra
    with tempfile.TemporaryDirectory(prefix=f"margins_{case}_{seed}_") as tmp:
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        out = Path(tmp) / "run"
        args = [o.format(prompts=prompts) for o in overrides]
        args += ["trainer.progress_bar=false", f"trainer.seed={seed}", f"trainer.output_dir={out}"]
        env = {**os.environ, **PINNED_NUMERICS, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        cmd = [sys.executable, "-c", RUNNER, trainer, config, *args]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{case} seed {seed} failed:\n{done.stderr[-3000:]}")
        return figures(out, wanted)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--set", nargs="+", default=[], help="overrides that replace the case's own")
    args = parser.parse_args()
    jobs = [(case, seed) for case in args.cases for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        for (case, seed), result in zip(jobs, pool.map(lambda job: measure(*job, args.set), jobs)):
            rounded = {k: v if isinstance(v, dict) else round(v, 4) for k, v in result.items()}
            print(json.dumps({"case": case, "seed": seed, **rounded}), flush=True)


if __name__ == "__main__":
    main()

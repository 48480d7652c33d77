"""DDP against FSDP2 at real width: per-rank memory and step time of 2 CPU ranks (gloo), next to the plan.

    python benchmarks/bench_fsdp.py                          # DiT, full fine-tuning, 2 layers, 256²
    python benchmarks/bench_fsdp.py --component ar --lora    # other cases

Each case launches `torchrun --nproc_per_node=2` on this file once per strategy. Every rank builds the
trainer on the real-width fixture (`model=glm_image_shape`, bf16 weights, bf16 autocast) and runs one
training step (rollout, rewards, update, AdamW step). It reports the trainable elements it holds, its peak
resident memory over the whole process (loading included: VmHWM) and the step time; the table sets them
next to `glm_training.plan`'s per-rank peak for the same config. On CPU the frozen weights are memory-mapped
from the fixture's files (pages count once touched), so absolute figures are looser than the difference
between the strategies, which is what the benchmark is for.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GIB = 1024**3


def overrides(component: str, size: int, layers: int, lora: bool, strategy: str, out: Path) -> list[str]:
    common = [
        "model=glm_image_shape",
        f"model.shape_num_ar_layers={layers}",  # both stacks: one fixture build serves both halves
        f"model.shape_num_dit_layers={layers}",
        f"model.lora.enabled={str(lora).lower()}",
        "trainer.mixed_precision=bf16",
        f"trainer.strategy={strategy}",
        f"trainer.output_dir={out}",
        "trainer.progress_bar=false",
        "data.num_groups_per_step=2",
        "data.num_generations=2",
        "eval.every_n_steps=0",
        "algo.beta=0",
        f"sampling.height={size}",
        f"sampling.width={size}",
    ]
    if component == "dit":
        return [
            "--config",
            "configs/t2i_training.yaml",
            *common,
            "sampling.num_steps=3",
            "sampling.micro_batch_size=1",
            "algo.num_mini_batches=1",
        ]
    return [
        "--config",
        "configs/ar_training.yaml",
        *common,
        "sampling.dit_num_steps=1",
        "algo.micro_batch_size=1",
        "algo.dynamic_sampling=false",
    ]


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(out: Path, args: list[str]) -> None:
    """One rank: build the trainer, run one step, write `<out>/rank<r>.json`."""
    from glm_training.config import load_config
    from glm_training.distributed import collectives as dist
    from glm_training.engine.trainer import ARTrainer, DiTTrainer
    from glm_training.models.placement import trainable_counts

    cfg = load_config(args, "t2i_training")
    trainer = (DiTTrainer if cfg.component == "dit" else ARTrainer)(cfg)
    local, total = trainable_counts(trainer.policy.trainable)
    dist.barrier()
    start = time.perf_counter()
    batch = trainer.collect(0)
    trainer.update(batch, 0)
    seconds = time.perf_counter() - start
    report = {"local": local, "total": total, "peak_bytes": vm_hwm(), "step_s": seconds}
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(report))
    dist.barrier()


def run_case(component: str, size: int, layers: int, lora: bool) -> dict:
    from glm_training.config import load_config
    from glm_training.plan import build_plan

    results = {}
    for strategy in ("ddp", "fsdp"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            args = overrides(component, size, layers, lora, strategy, out / "run")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0"]
            cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", __file__, "--worker", str(out)]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
            proc = subprocess.run([*cmd, "--", *args], env=env, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"{strategy} failed:\n{proc.stderr[-3000:]}")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        plan = build_plan(load_config(args, "t2i_training"), world_size=2, strategy=strategy)
        results[strategy] = {"ranks": ranks, "plan_peak_bytes": plan.peak}
    return results


def table(case: str, results: dict) -> str:
    rows = [f"| {case} | strategy | trainable held per rank | peak RSS per rank | planned peak | step |"]
    rows.append("|---|---|---|---|---|---|")
    for strategy, r in results.items():
        ranks = r["ranks"]
        held = "/".join(f"{x['local'] / x['total']:.0%}" for x in ranks)
        peak = max(x["peak_bytes"] for x in ranks) / GIB
        step = max(x["step_s"] for x in ranks)
        rows.append(
            f"| | {strategy} | {held} of {ranks[0]['total'] / 1e6:.0f}M | {peak:.2f} GiB | "
            f"{r['plan_peak_bytes'] / GIB:.2f} GiB | {step:.1f} s |"
        )
    ddp, fsdp = (max(x["peak_bytes"] for x in results[s]["ranks"]) for s in ("ddp", "fsdp"))
    planned = results["ddp"]["plan_peak_bytes"] - results["fsdp"]["plan_peak_bytes"]
    rows.append(
        f"\nFSDP saves {(ddp - fsdp) / GIB:.2f} GiB per rank (measured) vs {planned / GIB:.2f} GiB (planned)."
    )
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[sys.argv.index("--") + 1 :])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--component", choices=("dit", "ar"), default="dit")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    case = f"{args.component} {'LoRA' if args.lora else 'full'}, {args.layers} layers, {args.size}²"
    print(table(case, run_case(args.component, args.size, args.layers, args.lora)))


if __name__ == "__main__":
    main()

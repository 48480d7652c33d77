"""`accelerate launch` starts the entry points like torchrun: 2 CPU processes (gloo), the same numbers."""

from __future__ import annotations

import pytest
from conftest import DIT_SMALL, PYTHON, run_cli, torchrun

from glm_training.distributed.collectives import LaunchError, rank_info
from glm_training.metrics import read_metrics

ARGS = [*DIT_SMALL, "trainer.num_steps=2", "trainer.save_every=0"]
# Every value the launcher would otherwise warn about; port 0 = a free one.
ACCELERATE = [
    PYTHON,
    "-m",
    "accelerate.commands.launch",
    "--num_machines=1",
    "--mixed_precision=no",
    "--dynamo_backend=no",
    "--main_process_port=0",
]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "step_time_s"} for row in rows]


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_launch_trains_like_torchrun(tmp_path):
    by_accelerate, by_torchrun = tmp_path / "accelerate", tmp_path / "torchrun"
    launch = [*ACCELERATE, "--multi_gpu", "--num_processes=2", "train_dit.py"]
    result = run_cli([*launch, *ARGS, f"trainer.output_dir={by_accelerate}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done: outputs in") == 2  # two processes ran the entry point
    checkpoint = by_accelerate / "checkpoints" / "step-000002"
    assert sorted(p.name for p in checkpoint.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]

    reference = torchrun("train_dit.py", [*ARGS, f"trainer.output_dir={by_torchrun}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    rows = read_metrics(by_accelerate / "metrics.jsonl")
    assert len(rows) == 2
    assert comparable(rows) == comparable(read_metrics(by_torchrun / "metrics.jsonl"))


@pytest.mark.slow
def test_a_single_process_accelerate_launch_asked_for_two_is_refused(tmp_path):
    # Without GPUs and without --multi_gpu, accelerate starts one process; it must not train alone.
    launch = [*ACCELERATE, "--num_processes=2", "train_dit.py"]
    result = run_cli([*launch, *ARGS, f"trainer.output_dir={tmp_path}"], timeout=120)
    assert result.returncode != 0
    assert "--multi_gpu" in result.stderr and "[load]" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_launch_detection_reads_only_what_launchers_set():
    accelerate_env = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no"}
    with pytest.raises(LaunchError, match="torchrun --nproc_per_node=N"):
        rank_info({**accelerate_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    # One process (accelerate sets no MASTER_ADDR then), torchrun underneath, or a plain run: fine.
    assert rank_info(accelerate_env).world_size == 1
    torchrun_env = {**accelerate_env, "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "RANK": "1"}
    assert rank_info(torchrun_env).rank == 1
    assert rank_info({"MASTER_ADDR": "10.0.0.1"}).world_size == 1

"""Preemption and dead or stalled ranks, with real processes: SIGTERM, SIGUSR1, SIGKILL and SIGSTOP."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from conftest import DIT_SMALL, PYTHON
from process_helpers import TORCHRUN, Run, group_members, is_running, wait_until_gone
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.metrics import read_metrics
from glm_training.trainers.dit_trainer import DiTTrainer

NUM_STEPS = 4
# No TensorBoard: it adds start-up time and nothing these tests look at.
SMALL = [*DIT_SMALL, "logging.tensorboard=false"]


def checkpoints(output_dir) -> list[int]:
    root = output_dir / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if not p.name.endswith(".tmp"))


def assert_same_weights(a_dir, b_dir, step: int) -> None:
    a = load_file(str(a_dir / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))
    b = load_file(str(b_dir / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_metrics(a_dir, b_dir) -> None:
    rows_a, rows_b = read_metrics(a_dir / "metrics.jsonl"), read_metrics(b_dir / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a] == list(range(1, NUM_STEPS + 1))
    for x, y in zip(rows_a, rows_b):
        assert (x["reward_mean"], x["loss"]) == (y["reward_mean"], y["loss"]), x["step"]


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for r in started:
        r.kill_all()


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_reached_and_resume_is_exact(tmp_path, runs):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "trainer.save_every=0", f"trainer.num_steps={NUM_STEPS}"]
    assert run(DiTTrainer, "t2i_training", [*args, f"trainer.output_dir={full}"]) == 0

    job = Run([PYTHON, "train_dit.py", *args, f"trainer.output_dir={part}"], tmp_path / "part.log")
    runs.append(job)
    job.wait_for(f"step 1/{NUM_STEPS}")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 0, job.text()[-3000:]
    log = job.text()
    assert "SIGTERM received" in log and "stopped at step" in log, log[-2000:]
    (reached,) = checkpoints(part)  # the step it was in when the signal came, not the end
    assert 2 <= reached < NUM_STEPS
    assert [r["step"] for r in read_metrics(part / "metrics.jsonl")] == list(range(1, reached + 1))

    resumed = [*args, f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run(DiTTrainer, "t2i_training", resumed) == 0
    assert_same_weights(full, part, NUM_STEPS)
    assert_same_metrics(full, part)


@pytest.mark.slow
def test_sigusr1_asks_to_stop_and_a_second_signal_exits_at_once(tmp_path, runs):
    job = Run(
        [
            PYTHON,
            "train_dit.py",
            *SMALL,
            "trainer.num_steps=50",
            f"trainer.output_dir={tmp_path}",
            # A slow reward: the second signal surely comes while the first step is still running.
            "reward.names=[tests/user_rewards/faults.py:slow_brightness]",
        ],
        tmp_path / "run.log",
    )
    runs.append(job)
    job.wait_for("step 1/50")
    job.proc.send_signal(signal.SIGUSR1)
    job.wait_for("SIGUSR1 received: finishing the current step", timeout=30)
    sent = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - sent < 5
    assert "second stop signal (SIGTERM): exiting now" in job.text()


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resume_is_exact(tmp_path, runs):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "trainer.save_every=0", f"trainer.num_steps={NUM_STEPS}"]
    reference = Run([*TORCHRUN, "train_dit.py", *args, f"trainer.output_dir={full}"], tmp_path / "full.log")
    runs.append(reference)
    assert reference.wait(timeout=300) == 0, reference.text()[-3000:]

    job = Run([*TORCHRUN, "train_dit.py", *args, f"trainer.output_dir={part}"], tmp_path / "part.log")
    runs.append(job)
    job.wait_for(f"step 1/{NUM_STEPS}")
    # torchrun forwards a SIGTERM it gets to every rank; a signal that reaches one rank alone is the case
    # where the ranks must agree.
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGTERM)
    assert job.wait(timeout=180) == 0, job.text()[-3000:]
    log = job.text()
    assert "[rank 1] SIGTERM received" in log and "[rank 0] SIGTERM received" not in log
    (reached,) = checkpoints(part)
    assert 2 <= reached < NUM_STEPS
    folder = part / "checkpoints" / f"step-{reached:06d}"
    assert (folder / "rng_rank0.pt").is_file() and (folder / "rng_rank1.pt").is_file()  # both ranks saved
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == reached

    resumed = Run(
        [*TORCHRUN, "train_dit.py", *args, f"trainer.output_dir={part}", "trainer.resume=latest"],
        tmp_path / "resumed.log",
    )
    runs.append(resumed)
    assert resumed.wait(timeout=300) == 0, resumed.text()[-3000:]
    assert_same_weights(full, part, NUM_STEPS)
    assert_same_metrics(full, part)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_survivor_of_a_dead_or_stalled_rank_fails_in_bounded_time_naming_the_phase(tmp_path, runs, sig):
    bound = 6
    args = [*SMALL, "trainer.num_steps=50", f"trainer.dist_timeout_s={bound}"]
    args.append(f"trainer.output_dir={tmp_path}")
    job = Run([*TORCHRUN, "train_dit.py", *args], tmp_path / "run.log")
    runs.append(job)
    job.wait_for("step 1/50")
    ranks = job.ranks()
    os.kill(ranks[1], sig)
    took = wait_until_gone(ranks[0], timeout=bound + 60)
    assert took < bound + 15, took  # within the bound (and a margin for a loaded 2-core machine)
    time.sleep(1)  # the survivor's last lines reach the log
    log = job.text()
    assert "rank 0: a collective failed at step" in log, log[-3000:]
    assert "rank 1 was last in step" in log  # where the dead or stopped rank was, from the rendezvous store
    assert any(f"phase '{p}'" in log for p in ("rollout", "reward gather", "update", "checkpoint")), log[
        -3000:
    ]
    if sig == signal.SIGSTOP:
        assert f"trainer.dist_timeout_s={bound}" in log
    job.kill_all()
    assert group_members(job.proc.pid) == []
    assert not any(is_running(pid) for pid in ranks.values())  # the workers' own sessions too

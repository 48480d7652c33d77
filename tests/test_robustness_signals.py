"""Preemption and dead or stalled ranks, with real processes: SIGTERM, SIGUSR1, SIGKILL and SIGSTOP.

No test depends on timing: a run to be signalled mid-step scores with `gated_brightness`, whose first call
holds the step at a gate (a file) until the test creates it, after the run's log says the signal was handled;
a log is read only once every process writing it has ended.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import DIT_SMALL, PYTHON, REPO
from process_helpers import TORCHRUN, Run, group_members, is_running, wait_until_gone
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.engine.trainer import DiTTrainer
from glm_training.metrics import read_metrics

NUM_STEPS = 3
# No TensorBoard: it adds start-up time and nothing these tests look at.
SMALL = [*DIT_SMALL, "logging.tensorboard=false"]
# Brightness; in a run started with GLM_TEST_GATE=<file>, the first step waits until the file exists.
GATED = f"{REPO}/tests/user_rewards/faults.py:gated_brightness"
AT_THE_GATE = "reward waiting at the gate"


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
    full, part, gate = tmp_path / "full", tmp_path / "part", tmp_path / "gate"
    args = [*SMALL, "trainer.save_every=0", f"trainer.num_steps={NUM_STEPS}", f"reward.names=[{GATED}]"]
    assert run(DiTTrainer, "t2i_training", [*args, f"trainer.output_dir={full}"]) == 0  # no gate

    cmd = [PYTHON, "train_dit.py", *args, f"trainer.output_dir={part}"]
    job = Run(cmd, tmp_path / "part.log", env={"GLM_TEST_GATE": str(gate)})
    runs.append(job)
    job.wait_for(f"[rank 0] {AT_THE_GATE}")  # step 1 cannot end before the gate opens
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for("[rank 0] SIGTERM received")  # the handler has recorded the request
    gate.touch()
    assert job.wait(timeout=120) == 0, job.text()[-3000:]
    log = job.text()
    assert "stopped at step 1 on a stop signal" in log, log[-2000:]
    (reached,) = checkpoints(part)  # the step it was in when the signal came, not the end
    assert reached == 1
    assert [r["step"] for r in read_metrics(part / "metrics.jsonl")] == list(range(1, reached + 1))

    resumed = [*args, f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run(DiTTrainer, "t2i_training", resumed) == 0
    assert_same_weights(full, part, NUM_STEPS)
    assert_same_metrics(full, part)


@pytest.mark.slow
def test_sigusr1_asks_to_stop_and_a_second_signal_exits_at_once(tmp_path, runs):
    out, gate = tmp_path / "out", tmp_path / "gate"
    args = [*SMALL, f"trainer.num_steps={NUM_STEPS}", f"reward.names=[{GATED}]", f"trainer.output_dir={out}"]
    # The gate is never opened: step 1 cannot end, so only the second signal can end the run.
    job = Run([PYTHON, "train_dit.py", *args], tmp_path / "run.log", env={"GLM_TEST_GATE": str(gate)})
    runs.append(job)
    job.wait_for(f"[rank 0] {AT_THE_GATE}")
    job.proc.send_signal(signal.SIGUSR1)
    job.wait_for("[rank 0] SIGUSR1 received: finishing the current step")
    job.proc.send_signal(signal.SIGTERM)
    assert job.wait(timeout=120) == 128 + signal.SIGTERM  # (the timeout only guards against a hang)
    log = job.text()
    assert "second stop signal (SIGTERM): exiting now" in log
    # At once: inside the step the first signal came in, without finishing it or writing a checkpoint.
    assert "step 1/" not in log and "stopped at step" not in log, log[-2000:]
    assert not (out / "checkpoints").exists() or checkpoints(out) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_rank_stops_both_at_the_same_step_and_resume_is_exact(tmp_path, runs):
    full, part, gate = tmp_path / "full", tmp_path / "part", tmp_path / "gate"
    args = [*SMALL, "trainer.save_every=0", f"trainer.num_steps={NUM_STEPS}", f"reward.names=[{GATED}]"]
    reference = Run([*TORCHRUN, "train_dit.py", *args, f"trainer.output_dir={full}"], tmp_path / "full.log")
    runs.append(reference)
    assert reference.wait(timeout=300) == 0, reference.text()[-3000:]

    cmd = [*TORCHRUN, "train_dit.py", *args, f"trainer.output_dir={part}"]
    job = Run(cmd, tmp_path / "part.log", env={"GLM_TEST_GATE": str(gate)})
    runs.append(job)
    job.wait_for(f"[rank 1] {AT_THE_GATE}")  # no rank can end step 1 before the gate opens
    # torchrun forwards a SIGTERM it gets to every rank; a signal that reaches one rank alone is the case
    # where the ranks must agree.
    ranks = job.ranks()
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGTERM)
    job.wait_for("[rank 1] SIGTERM received")
    gate.touch()
    assert job.wait(timeout=180) == 0, job.text()[-3000:]
    log = job.text()
    assert "[rank 1] SIGTERM received" in log and "[rank 0] SIGTERM received" not in log
    assert "stopped at step 1 on a stop signal (received by another rank)" in log, log[-3000:]
    (reached,) = checkpoints(part)
    assert reached == 1
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
    # Only a guard against a hang: far below the 600 s default of trainer.dist_timeout_s and the loading
    # bound, so a survivor that waits out one of those instead of the bound fails here.
    wait_until_gone(ranks[0], timeout=bound + 120)
    job.kill_all()  # the launcher and the dead or stopped rank too: no process writes to the log any more
    log = job.text()
    assert "rank 0: a collective failed at step" in log, log[-3000:]
    assert "CollectiveFailure: rank 0: a collective failed" in log  # it ended by raising the failure
    assert "rank 1 was last in step" in log  # where the dead or stopped rank was, from the rendezvous store
    assert any(f"phase '{p}'" in log for p in ("rollout", "reward gather", "update", "checkpoint")), log[
        -3000:
    ]
    if sig == signal.SIGSTOP:
        assert f"trainer.dist_timeout_s={bound}" in log
        # The collective that failed waited the bound, not a default: gloo's own timeout, in ms.
        assert f"timed out waiting {bound * 1000}ms" in log.lower(), log[-3000:]
    assert group_members(job.proc.pid) == []
    assert not any(is_running(pid) for pid in ranks.values())  # the workers' own sessions too

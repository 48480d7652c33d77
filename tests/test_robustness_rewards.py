"""Reward failures: retries with back-off, then skip the step or stop; the reward server restarted mid-run."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from conftest import DIT_SMALL, REPO, torchrun
from PIL import Image

from glm_training.cli import run
from glm_training.engine.trainer import DiTTrainer
from glm_training.metrics import read_metrics
from glm_training.rewards import RewardSet, build_reward
from glm_training.rewards.retry import FailurePolicy, RewardFailed, call_with_retries
from glm_training.rewards.server import RewardServer

FLAKY = f"{REPO}/tests/user_rewards/faults.py:FailsOnCalls"


def test_retries_wait_with_exponential_backoff_then_fail_naming_the_reward():
    waits: list[float] = []
    calls = []

    def always_fails():
        calls.append(1)
        raise ConnectionError("refused")

    policy = FailurePolicy(max_retries=3, backoff_s=0.5)
    with pytest.raises(RewardFailed, match=r"reward 'judge' failed 4 time\(s\).*ConnectionError: refused"):
        call_with_retries(always_fails, name="judge", retryable=True, policy=policy, sleep=waits.append)
    assert len(calls) == 4 and waits == [0.5, 1.0, 2.0]  # backoff_s * 2**k before retry k+1


def test_a_reward_that_is_not_retryable_fails_at_once():
    calls = []

    def bug():
        calls.append(1)
        raise KeyError("a bug in the reward")

    with pytest.raises(KeyError):
        call_with_retries(bug, name="mine", retryable=False, policy=FailurePolicy(max_retries=5), sleep=None)
    assert len(calls) == 1


def test_reward_set_retries_a_retryable_reward_and_records_what_failed_for_good():
    images, prompts, metadata = [Image.new("RGB", (8, 8), (255, 255, 255))] * 2, ["a", "b"], [{}, {}]
    rewards = RewardSet({FLAKY: 1.0}, {FLAKY: {"fail_calls": [1, 3, 4]}})
    rewards.policy = FailurePolicy(max_retries=1, backoff_s=0.0)
    rewards.defer_errors = True  # as while the trainer collects a step
    assert rewards(images, prompts, metadata)[FLAKY].tolist() == [1.0, 1.0]  # call 1 failed, call 2 did not
    assert rewards.failures == []
    scores = rewards(images, prompts, metadata)[FLAKY]  # calls 3 and 4 fail: out of retries
    assert scores.isnan().all() and len(rewards.failures) == 1 and "failed 2 time(s)" in rewards.failures[0]


@pytest.mark.parametrize("on_failure", ["skip", "error"])
def test_a_reward_out_of_retries_skips_the_step_or_stops_the_run(tmp_path, capsys, on_failure):
    # Calls 2-4 fail: step 2's call and both its retries. Steps 1 and 3 score normally.
    args = [
        *DIT_SMALL,
        "trainer.num_steps=3",
        "trainer.save_every=1",
        f"trainer.output_dir={tmp_path}",
        f"reward.names=[{FLAKY}]",
        "reward.max_retries=2",
        "reward.retry_backoff_s=0",
        f"reward.on_failure={on_failure}",
    ]
    code = run(DiTTrainer, "t2i_training", args)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    if on_failure == "error":
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"step 2: reward '{FLAKY}' failed 3 time(s)" in err and "reward.on_failure=skip" in err
        assert names == ["step-000001"]
        return
    assert code == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped_reward_failure"] for r in rows] == [0, 1, 0]
    assert "loss" not in rows[1] and "loss" in rows[2]
    assert names == ["step-000001", "step-000003"]


@pytest.mark.slow
def test_the_remote_reward_server_restarted_mid_run_the_run_retries_and_continues(tmp_path, caplog):
    restarted = threading.Event()
    holder: dict = {}

    class RestartingReward:
        """Hosted by the server: its second batch takes the server down, which comes back once the trainer
        has met the closed port."""

        def __init__(self):
            self.inner = build_reward("jpeg_compressibility")
            self.num_calls = 0

        def check_prompts(self, prompts, metadata):
            pass

        def __call__(self, images, prompts, metadata):
            self.num_calls += 1
            if self.num_calls == 2 and not restarted.is_set():
                stop()  # the port is closed before this call's error answer goes out
                raise RuntimeError("going down for a restart")
            return self.inner(images, prompts, metadata)

    class RestartOnSecondRetry(logging.Handler):
        """Starts the server again when the trainer logs its second retry, the attempt that met the closed
        port."""

        def __init__(self):
            super().__init__()
            self.num_retries = 0

        def emit(self, record):
            if "retrying in" in record.getMessage():
                self.num_retries += 1
                if self.num_retries == 2:
                    start(holder["port"])
                    restarted.set()

    hosted = RestartingReward()

    def start(port: int) -> None:
        server = RewardServer(hosted, "127.0.0.1", port)
        holder["server"], holder["port"] = server, server.server_address[1]
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop() -> None:
        holder["server"].shutdown()
        holder["server"].server_close()

    hosted.name = "jpeg_compressibility"
    start(0)
    url = f"http://127.0.0.1:{holder['server'].server_address[1]}"
    args = [
        *DIT_SMALL,
        "trainer.num_steps=3",
        f"trainer.output_dir={tmp_path}",
        "reward.names=[remote]",
        # The client's own retries off: the trainer's reward.max_retries does the waiting here.
        f"+reward.options.remote.url={url}",
        "+reward.options.remote.max_retries=0",
        "reward.max_retries=6",
        "reward.retry_backoff_s=0.1",
    ]
    restarter = RestartOnSecondRetry()
    logging.getLogger("glm_training").addHandler(restarter)
    try:
        with caplog.at_level(logging.WARNING, logger="glm_training"):
            assert run(DiTTrainer, "t2i_training", args) == 0
    finally:
        logging.getLogger("glm_training").removeHandler(restarter)
        stop()
    assert restarted.is_set()
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) >= 2 and "reward 'remote' failed (attempt 1/7" in retries[0]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["skipped_reward_failure"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_reward_raising_on_one_rank_stops_both_ranks_at_once(tmp_path):
    args = [
        *DIT_SMALL,
        "trainer.num_steps=2",
        "trainer.dist_timeout_s=300",
        f"trainer.output_dir={tmp_path}",
        f"reward.names=[{REPO}/tests/user_rewards/faults.py:fails_on_rank_1]",
    ]
    start = time.monotonic()
    result = torchrun("train_dit.py", args, timeout=240)
    took = time.monotonic() - start
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert (
        "KeyError: 'a bug in the reward that only rank 1 hits (test fault)'" in log
    )  # rank 1, its own error
    assert "error: step 1: a reward failed on another rank (its log says how)" in log  # rank 0, exit 2
    assert "a collective failed" not in log and took < 200  # agreed at once, not after dist_timeout_s

"""Non-finite values: a reward returning NaN, a loss made NaN by a fault the test injects, skip streaks."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DIT_SMALL, REPO
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.engine.trainer import DiTTrainer
from glm_training.guards import SkipCounter, TooManySkippedSteps, nonfinite_groups
from glm_training.metrics import read_metrics

NAN_REWARD = f"{REPO}/tests/user_rewards/faults.py:nan_for_first"


def weights(output_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def assert_all_finite(state: dict[str, torch.Tensor]) -> None:
    assert state and all(torch.isfinite(v).all() for v in state.values())


class NaNLossTrainer(DiTTrainer):
    """A test-only fault: during the update of the steps in `bad_steps` (1-based), one layer's output is
    multiplied by NaN, so the loss and every gradient turn NaN. The rollout is untouched."""

    bad_steps: set[int] = set()

    def update(self, batch, step):
        leaf = [m for m in self.policy.trainable.modules() if isinstance(m, torch.nn.Linear)][-1]
        hook = (
            leaf.register_forward_hook(lambda m, i, out: out * math.nan)
            if step + 1 in self.bad_steps
            else None
        )
        try:
            return super().update(batch, step)
        finally:
            if hook is not None:
                hook.remove()


def test_nonfinite_groups_marks_groups_with_any_nan_or_inf():
    rewards_gk = torch.tensor([[1.0, 2.0], [math.nan, 0.0], [0.0, math.inf], [3.0, 3.0]])
    assert nonfinite_groups(rewards_gk).tolist() == [False, True, True, False]


def test_skip_counter_stops_after_k_in_a_row_and_an_update_resets_it():
    skips = SkipCounter(max_consecutive=2)
    for skipped in (True, False, True):
        skips.record(skipped, "non-finite loss")
        skips.check(step=1)
    skips.record(True, "reward failure")
    with pytest.raises(TooManySkippedSteps, match=r"2 steps in a row \(through step 4\).*non-finite loss"):
        skips.check(step=4)
    assert SkipCounter(max_consecutive=0).max_consecutive == 0  # 0 = never stop


def test_a_nan_reward_stops_the_run_naming_the_reward(tmp_path, capsys):
    args = [
        *DIT_SMALL,
        "trainer.num_steps=2",
        f"trainer.output_dir={tmp_path}",
        f"reward.names=[{NAN_REWARD}]",
    ]
    assert run(DiTTrainer, "t2i_training", args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"reward '{NAN_REWARD}' returned non-finite scores at indices [0]" in err
    assert "reward.on_nonfinite=drop" in err
    assert not (tmp_path / "checkpoints").exists()


def test_a_nan_reward_with_drop_gives_its_group_zero_advantage(tmp_path):
    args = [
        *DIT_SMALL,
        "trainer.num_steps=2",
        f"trainer.output_dir={tmp_path}",
        f"reward.names=[{NAN_REWARD}]",
        "reward.on_nonfinite=drop",
    ]
    assert run(DiTTrainer, "t2i_training", args) == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    # 2 groups of 3 on one rank, scored in one chunk: sample 0 is NaN, its group is dropped, the other trains.
    assert [r["dropped_nonfinite_groups"] for r in rows] == [1, 1]
    assert all(math.isfinite(r["reward_mean"]) for r in rows)
    assert all(r["skipped_nonfinite"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert_all_finite(weights(tmp_path, 2))


def test_a_nan_loss_makes_no_update_and_the_run_goes_on(tmp_path):
    NaNLossTrainer.bad_steps = {2}
    args = [*DIT_SMALL, "trainer.num_steps=3", "trainer.save_every=1", f"trainer.output_dir={tmp_path}"]
    assert run(NaNLossTrainer, "t2i_training", args) == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 0]
    assert rows[1]["loss"] == "nan" and rows[1]["lr"] == rows[0]["lr"]
    # No checkpoint while steps are being skipped; the optimizer took 2 steps in 3 (step 2 made none).
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001", "step-000003"]
    optimizer = torch.load(tmp_path / "checkpoints" / "step-000003" / "optimizer.pt", weights_only=True)
    assert {float(state["step"]) for state in optimizer["state"].values()} == {2.0}
    one, three = weights(tmp_path, 1), weights(tmp_path, 3)
    assert any(not torch.equal(one[k], three[k]) for k in one)  # step 3 trained again
    assert_all_finite(three)


def test_k_nan_steps_in_a_row_stop_the_run_and_keep_the_last_good_checkpoint(tmp_path, capsys):
    NaNLossTrainer.bad_steps = {2, 3, 4, 5}
    args = [
        *DIT_SMALL,
        "trainer.num_steps=5",
        "trainer.save_every=1",
        "trainer.max_consecutive_skips=2",
        f"trainer.output_dir={tmp_path}",
    ]
    assert run(NaNLossTrainer, "t2i_training", args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "2 steps in a row (through step 3) made no update (non-finite loss)" in err
    assert "trainer.max_consecutive_skips=2" in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    assert_all_finite(weights(tmp_path, 1))


def test_a_failed_collective_is_described_by_rank_step_and_phase():
    from glm_training.distributed import collectives as dist

    with pytest.raises(ValueError, match="unknown phase 'training'"):
        dist.set_phase("training", 3)
    dist.set_phase("update", 7)
    dist.set_phase("reward gather")  # keeps the step
    err = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    assert dist.is_collective_failure(err) and not dist.is_collective_failure(RuntimeError("CUDA OOM"))
    message = dist.describe_failure(err, 60.0)
    assert message.startswith("rank 0: a collective failed at step 7, phase 'reward gather'")
    assert "trainer.dist_timeout_s=60" in message and "Connection closed by peer" in message
    dist._current.update(phase="start-up", step=None)  # as a fresh process starts

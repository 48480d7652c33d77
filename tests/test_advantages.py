"""Golden tests for the GRPO group-relative advantages."""

import numpy as np
import pytest
import torch

from glm_training.engine.advantages import (
    batch_std_advantages,
    centered_advantages,
    clip_advantages,
    group_normalized_advantages,
    rewards_to_groups,
    zero_std_groups,
)

REWARDS_GK = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0]])


def _random_rewards(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(5, 4)).astype(np.float32)


def test_group_normalized_by_hand() -> None:
    # group 0: mean 2, population std sqrt((1 + 0 + 1)/3) = 0.81649658
    #   adv = [-1, 0, 1] / (0.81649658 + 1e-4) = [-1.22459489, 0, 1.22459489]
    # group 1: all equal -> 0 / (0 + 1e-4) = 0
    adv = group_normalized_advantages(REWARDS_GK)
    assert adv.dtype == torch.float32
    expected = torch.tensor([[-1.22459489, 0.0, 1.22459489], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_group_normalized_matches_numpy() -> None:
    r = _random_rewards()
    expected = (r - r.mean(axis=1, keepdims=True)) / (np.std(r, axis=1, keepdims=True) + 1e-4)
    torch.testing.assert_close(
        group_normalized_advantages(torch.from_numpy(r)), torch.from_numpy(expected), atol=1e-5, rtol=1e-5
    )
    # integer rewards (e.g. 0/1 correctness) come out float32
    assert group_normalized_advantages(torch.tensor([[0, 1], [1, 1]])).dtype == torch.float32


def test_batch_std_by_hand() -> None:
    # all six rewards: mean 3, squared deviations 4+1+0+1+1+1 = 8, population std sqrt(8/6) = 1.15470054
    # group 0 centred [-1, 0, 1] / (1.15470054 + 1e-4) = [-0.86595041, 0, 0.86595041]
    expected = torch.tensor([[-0.86595041, 0.0, 0.86595041], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(batch_std_advantages(REWARDS_GK), expected, atol=1e-6, rtol=0)


def test_batch_std_matches_numpy() -> None:
    r = _random_rewards(1)
    expected = (r - r.mean(axis=1, keepdims=True)) / (np.std(r) + 1e-4)
    torch.testing.assert_close(
        batch_std_advantages(torch.from_numpy(r)), torch.from_numpy(expected), atol=1e-5, rtol=1e-5
    )


def test_centered() -> None:
    # group 0 mean 2 -> [-1, 0, 1]; group 1 mean 4 -> 0
    expected = torch.tensor([[-1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(centered_advantages(REWARDS_GK), expected, atol=0, rtol=0)
    r = _random_rewards(2)
    torch.testing.assert_close(
        centered_advantages(torch.from_numpy(r)),
        torch.from_numpy(r - r.mean(axis=1, keepdims=True)),
        atol=1e-6,
        rtol=1e-6,
    )


def test_clip_advantages() -> None:
    adv = torch.tensor([-7.0, -5.0, -1.0, 0.0, 4.9, 5.0, 12.0])
    expected = torch.tensor([-5.0, -5.0, -1.0, 0.0, 4.9, 5.0, 5.0])
    torch.testing.assert_close(clip_advantages(adv, 5.0), expected, atol=0, rtol=0)
    torch.testing.assert_close(
        clip_advantages(adv, 5.0), torch.from_numpy(np.clip(adv.numpy(), -5, 5)), atol=0, rtol=0
    )
    with pytest.raises(ValueError, match="max_abs"):
        clip_advantages(adv, 0.0)


def test_zero_std_groups() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 2.0 + 1e-6, 2.0]])
    assert zero_std_groups(rewards).tolist() == [True, False, False]
    assert zero_std_groups(rewards, atol=1e-5).tolist() == [True, False, True]
    # numpy cross-check: a group has zero std exactly when np.std is 0
    r = np.array([[3.0, 3.0], [1.0, 2.0]], dtype=np.float32)
    assert zero_std_groups(torch.from_numpy(r)).tolist() == (np.std(r, axis=1) == 0).tolist()


def test_layout_errors() -> None:
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_normalized_advantages(torch.ones(6))


def test_rewards_to_groups_round_trip() -> None:
    # flat order interleaves groups 7 and 3; groups sort by id: group 3 first, then 7
    rewards_n = torch.tensor([10.0, 30.0, 11.0, 31.0, 12.0, 32.0])
    ids_n = torch.tensor([7, 3, 7, 3, 7, 3])
    rewards_gk, inverse_n = rewards_to_groups(rewards_n, ids_n)
    assert rewards_gk.dtype == torch.float32
    torch.testing.assert_close(
        rewards_gk, torch.tensor([[30.0, 31.0, 32.0], [10.0, 11.0, 12.0]]), atol=0, rtol=0
    )
    torch.testing.assert_close(rewards_gk.reshape(-1)[inverse_n], rewards_n, atol=0, rtol=0)

    # advantages scattered back agree with a per-sample numpy loop over groups
    g = torch.Generator().manual_seed(0)
    ids_n = torch.randperm(12, generator=g) % 4
    rewards_n = torch.randn(12, generator=g)
    rewards_gk, inverse_n = rewards_to_groups(rewards_n, ids_n)
    adv_n = group_normalized_advantages(rewards_gk).reshape(-1)[inverse_n]
    r, ids = rewards_n.numpy(), ids_n.numpy()
    expected = np.array(
        [(r[i] - r[ids == ids[i]].mean()) / (r[ids == ids[i]].std() + 1e-4) for i in range(12)]
    )
    torch.testing.assert_close(adv_n, torch.from_numpy(expected).float(), atol=1e-5, rtol=1e-5)


def test_rewards_to_groups_errors() -> None:
    with pytest.raises(ValueError, match=r"unequal sizes \(group id: size\) 0: 2, 1: 1"):
        rewards_to_groups(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="same length"):
        rewards_to_groups(torch.tensor([1.0, 2.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="empty"):
        rewards_to_groups(torch.tensor([]), torch.tensor([], dtype=torch.long))

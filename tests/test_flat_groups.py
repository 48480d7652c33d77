"""`flat_groups`: which groups count as flat for dynamic sampling and `frac_zero_std_groups`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm_training.engine.advantages import flat_groups, zero_std_groups


def test_flat_groups_golden_values():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.003], [0.0, 1.0, 2.0]])
    # Population stds: 0; sqrt(2 * 0.001^2 + 0.002^2) / sqrt(3) = 0.00141421; sqrt(2 / 3) = 0.81649658.
    assert flat_groups(rewards, 0.0).tolist() == [True, False, False]  # exact ties only
    assert flat_groups(rewards, 0.0015).tolist() == [True, True, False]
    assert flat_groups(rewards, 0.0014).tolist() == [True, False, False]
    assert flat_groups(rewards, 0.9).tolist() == [True, True, True]


def test_flat_groups_matches_numpy_and_the_tie_rule():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(64, 6, generator=generator) * torch.logspace(-8, 0, 64)[:, None]
    rewards[::7] = 0.25  # exact ties
    for min_std in (1e-6, 1e-3, 0.1):
        expected = np.std(rewards.double().numpy(), axis=1) < min_std
        assert flat_groups(rewards, min_std).tolist() == expected.tolist()
    assert torch.equal(flat_groups(rewards, 0.0), zero_std_groups(rewards))
    with pytest.raises(ValueError, match="min_std"):
        flat_groups(rewards, -1.0)

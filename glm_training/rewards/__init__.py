"""Rewards for RL fine-tuning: the registry, the offline rewards, and their weighted combination.

Importing this package registers every reward in it; heavy dependencies (OCR models) are imported
only when such a reward is built.
"""

from glm_training.rewards import jpeg, ocr  # noqa: F401  (imported to register the rewards)
from glm_training.rewards.combine import RewardSet
from glm_training.rewards.registry import Reward, available_rewards, build_reward, register_reward

__all__ = ["Reward", "RewardSet", "available_rewards", "build_reward", "register_reward"]

"""Rewards for RL fine-tuning: the registry, the scorers, and their combination.

Importing this package registers every reward in it. Reward models (CLIP, BLIP, OCR) and their libraries are
loaded only when such a reward is built.
"""

from glm_training.rewards import (  # noqa: F401  (imported to register the rewards)
    aesthetic,
    clip_score,
    hpsv2,
    imagereward,
    jpeg,
    ocr,
    pickscore,
    remote,
)
from glm_training.rewards.combine import RewardSet
from glm_training.rewards.registry import Reward, available_rewards, build_reward, register_reward

__all__ = ["Reward", "RewardSet", "available_rewards", "build_reward", "register_reward"]

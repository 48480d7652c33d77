"""Weighted sum of several rewards (the multi-reward setting of Flow-GRPO / DDPO configs).

total_n = sum_k weight_k * scores_k_n. Each reward's raw scores are returned too, for logging
and for per-reward statistics. Every reward's output is validated (shape [N], finite) so a broken
reward fails loudly with its name instead of silently poisoning the advantages.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from glm_training.rewards.registry import Reward, build_reward, check_reward_options


class RewardSet:
    """The rewards named in `weights`, built with `options[name]` as constructor keywords.

    Names, weights and options are all validated before any reward (and so any reward model) is
    built, so a typo fails at start-up with the available names and the closest match.
    """

    def __init__(self, weights: dict[str, float], options: dict[str, dict[str, Any]] | None = None) -> None:
        options = dict(options or {})
        if not weights:
            raise ValueError(
                "no rewards configured: give at least one reward name with its weight, e.g. {'ocr': 1.0}"
            )
        for name, weight in weights.items():
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward {name!r} has weight {weight!r}; weights must be finite numbers")
        stray = sorted(set(options) - set(weights))
        if stray:
            raise ValueError(
                f"options given for reward(s) {stray} that have no weight; add them to the weights "
                f"(weight 0.0 to only log them) or remove their options. Weighted rewards: {list(weights)}"
            )
        for name in weights:
            check_reward_options(name, options.get(name, {}))

        self.names: list[str] = list(weights)
        self.weights: dict[str, float] = {name: float(weight) for name, weight in weights.items()}
        self.rewards: dict[str, Reward] = {
            name: build_reward(name, **options.get(name, {})) for name in self.names
        }

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        """Run every reward's prompt check (ValueError naming the prompt and the fix)."""
        for reward in self.rewards.values():
            reward.check_prompts(prompts, metadata)

    def __call__(
        self, images: list[Image.Image], prompts: list[str], metadata: list[dict]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns (`total_n` weighted sum [N], {name: raw `scores_n` [N]}), float32 on CPU."""
        num_images = len(images)
        if not num_images == len(prompts) == len(metadata):
            raise ValueError(
                f"got {num_images} images, {len(prompts)} prompts and {len(metadata)} metadata entries"
            )
        total_n = torch.zeros(num_images, dtype=torch.float32)
        raw: dict[str, torch.Tensor] = {}
        for name, reward in self.rewards.items():
            scores_n = reward(images, prompts, metadata)
            if not isinstance(scores_n, torch.Tensor):
                raise TypeError(
                    f"reward {name!r} returned {type(scores_n).__name__}, expected a torch.Tensor"
                )
            if tuple(scores_n.shape) != (num_images,):
                raise ValueError(
                    f"reward {name!r} returned shape {tuple(scores_n.shape)} for {num_images} images; "
                    f"expected ({num_images},)"
                )
            scores_n = scores_n.detach().to(device="cpu", dtype=torch.float32)
            bad = ~torch.isfinite(scores_n)
            if bad.any():
                indices = bad.nonzero().flatten().tolist()
                raise ValueError(
                    f"reward {name!r} returned non-finite scores at indices {indices} "
                    f"(prompts {[prompts[i] for i in indices[:3]]})"
                )
            raw[name] = scores_n
            total_n += self.weights[name] * scores_n
        return total_n, raw

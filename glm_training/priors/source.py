"""`PriorSource`: what the DiT's rollout and evaluation read prior tokens from when its AR model does not
write them: a prior cache (`priors/read.py` `PriorCache`), the joint run's AR half (`joint/collect.py`
`StepPriors`), or anything else with these methods (the GPU check's `RandomPriors`, tests' own)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class PriorSource(Protocol):
    # [B, L] the held-out prompts' prior tokens from their texts; None where the evaluation samples its own
    # (the joint run's AR model, which trains).
    eval_tokens: Callable[[Sequence[str]], torch.Tensor] | None

    def step_tokens(self, texts: Sequence[str], seed: int, step: int) -> torch.Tensor:
        """[G, L] the prior tokens of the step's groups, identical on every rank."""
        ...

    def initial_latents(self) -> torch.Tensor | None:
        """This rank's initial noise for the rollout when the source fixes it (a joint run's per-prompt
        groups), else None: the rollout draws its own."""
        ...

"""`Parts`: what the engine hands an algorithm when it builds it (`Algorithm(cfg, parts)`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm_training.engine.collect import Collector
from glm_training.engine.policy import Policy
from glm_training.engine.update import UpdateLoop


@dataclass
class Parts:
    policy: Policy  # the trained half: model, reference, precision, optimizer step
    updates: UpdateLoop  # the shared update loop (inner epochs, mini-batches, optimizer steps)
    collector: Collector  # the step's samples and seeds, scoring, advantages
    # Where the DiT's prior tokens come from besides its AR model: a prior cache (`data.prior_cache`) or
    # anything with its `step_tokens(texts, seed, step)` and `eval_tokens` (and, to fix the rollout's initial
    # noise too, `initial_latents()`: train_joint.py's `StepPriors`); None for the AR model's own.
    priors: Any = None

"""`Parts`: what the engine hands an algorithm when it builds it (`Algorithm(cfg, parts)`)."""

from __future__ import annotations

from dataclasses import dataclass

from glm_training.engine.collect import Collector
from glm_training.engine.policy import Policy
from glm_training.engine.update import UpdateLoop
from glm_training.priors.source import PriorSource


@dataclass
class Parts:
    policy: Policy  # the trained half: model, reference, precision, optimizer step
    updates: UpdateLoop  # the shared update loop (inner epochs, mini-batches, optimizer steps)
    collector: Collector  # the step's samples and seeds, scoring, advantages
    # Where the DiT's prior tokens come from besides its AR model (`priors.source.PriorSource`: a prior cache,
    # train_joint.py's `StepPriors`); None for the AR model's own.
    priors: PriorSource | None = None

"""The device plan of a joint run (`train_joint.py`): both halves train on every rank.

It is the DiT half's plan (`device.build_plan`) with the AR half's own terms put in: the AR weights as its
strategy holds them (sharded under FSDP), its trainable parameters, gradients, optimizer state and copies,
its FSDP units, its buffers and its reward models. The two updates and the two rollout stages run one after
the other, so the transients are the larger of the two halves'.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glm_training.plan.device import build_plan
from glm_training.plan.report import MemoryPlan, Term

SHARED = "overhead"  # the fixed term both halves' plans hold once


def _own(terms: list[Term], prefix: str) -> list[Term]:
    """A half's own terms (not the components' weights nor the shared overhead), named by the half."""
    return [
        Term(f"{prefix}{t.name}", t.bytes, t.detail)
        for t in terms
        if not t.name.startswith("weights: ") and t.name != SHARED
    ]


def joint_plan(
    ar_cfg: Any,
    dit_cfg: Any,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    device_bytes: int | None = None,
    modules: dict[str, nn.Module],
) -> MemoryPlan:
    """The per-rank plan of a joint run from its two halves' run configs (`JointTrainConfig.half`)."""
    sizes = {"world_size": world_size, "strategy": strategy, "device_bytes": device_bytes, "modules": modules}
    dit, ar = build_plan(dit_cfg, **sizes), build_plan(ar_cfg, **sizes)
    # The weights as the DiT's plan holds them, but the AR model's as its own strategy holds it.
    ar_weights = next(t for t in ar.static if t.name == "weights: vision_language_encoder")
    weights = [
        ar_weights if t.name == ar_weights.name else t for t in dit.static if t.name.startswith("weights: ")
    ]
    plan = MemoryPlan("joint", dit.strategy, world_size, device_bytes=device_bytes)
    shared = [t for t in dit.static if t.name == SHARED]
    plan.static = [*weights, *_own(dit.static, "DiT: "), *_own(ar.static, "AR: "), *shared]
    plan.activations = max(dit.activations, ar.activations, key=lambda t: t.bytes)
    plan.rollout = max(dit.rollout, ar.rollout, key=lambda t: t.bytes)
    return plan

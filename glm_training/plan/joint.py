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


def _prefixed(terms: list[Term], prefix: str) -> list[Term]:
    return [Term(f"{prefix}{t.name}", t.bytes, t.detail) for t in terms]


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
    ar_weights = next(t for t in ar.static if t.name == "weights: vision_language_encoder")
    static = [ar_weights if t.name == ar_weights.name else t for t in dit.static]
    # Everything of the AR plan but the weights of the components (counted above) and the fixed overhead.
    ar_own = [t for t in ar.static if not t.name.startswith("weights: ") and t.name != "overhead"]
    plan = MemoryPlan("joint", dit.strategy, world_size, device_bytes=device_bytes)
    overhead = [t for t in static if t.name == "overhead"]
    plan.static = [
        *_prefixed([t for t in static if t.name != "overhead"], "DiT: "),
        *_prefixed(ar_own, "AR: "),
        *overhead,
    ]
    plan.static = [
        Term(t.name.replace("DiT: weights: ", "weights: "), t.bytes, t.detail) for t in plan.static
    ]
    plan.activations = max(dit.activations, ar.activations, key=lambda t: t.bytes)
    plan.activations_other = None
    plan.rollout = max(dit.rollout, ar.rollout, key=lambda t: t.bytes)
    return plan

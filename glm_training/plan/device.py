"""The device plan: what one rank will hold on its GPU during training, from the configs alone.

`build_plan` adds up the static terms (`state.py`: weights, trainable parameters, gradients, optimizer,
copies; `sharding.py`: FSDP's gathered units; `workload.py`: the trajectory buffers), the reward models
(each reward's `approx_params`, `rewards/registry.py`) and a fixed overhead, and sets the transients
(`transients.py`: activations, rollout).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glm_training.models.halves import model_half
from glm_training.plan.components import meta_components
from glm_training.plan.report import GIB, MemoryPlan, Term
from glm_training.plan.sharding import gathered_units, shard_count
from glm_training.plan.state import trained_state_terms, weight_terms
from glm_training.plan.transients import activation_terms, rollout_term
from glm_training.plan.workload import workload

# Importing the registry imports `glm_training.rewards`, which registers every reward (and its figure).
from glm_training.rewards.registry import reward_model_params

# Allocator slack, CUDA context, kernels' workspaces: what the terms do not see.
OVERHEAD_BYTES = 2 * GIB


def reward_term(names: list[str]) -> Term | None:
    """The reward models' weights on each rank (approximate parameter counts, float32); None without any."""
    reward_params = sum(reward_model_params(n) for n in names)
    if not reward_params:
        return None
    return Term("reward models", reward_params * 4, ", ".join(names) + " (approx.)")


def build_plan(
    cfg: Any,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    device_bytes: int | None = None,
    modules: dict[str, nn.Module] | None = None,
) -> MemoryPlan:
    """The per-rank plan of a DiT or AR training config (`cfg.component`)."""
    strategy = strategy or cfg.trainer.strategy
    shard = shard_count(cfg, world_size, strategy)
    modules = modules if modules is not None else meta_components(cfg.model)
    half = model_half(cfg.component)
    trained = modules[half.attribute]
    plan = MemoryPlan(
        cfg.component, strategy if world_size > 1 else "single process", world_size, device_bytes=device_bytes
    )
    plan.static += weight_terms(cfg, modules, half.attribute, shard)
    plan.static += trained_state_terms(cfg, trained, half, shard)
    rollout_gather = 0.0
    if shard > 1:
        units, rollout_gather = gathered_units(cfg, trained, half)
        plan.static.append(units)
    work = workload(cfg, modules, world_size)
    plan.static.append(work.buffers)
    plan.activations, plan.activations_other = activation_terms(
        cfg.model.gradient_checkpointing, half, len(half.layers(trained)), work
    )
    plan.rollout = rollout_term(cfg, modules, work, rollout_gather, half.attribute)
    rewards = reward_term(cfg.reward.names)
    if rewards is not None:
        plan.static.append(rewards)
    plan.static.append(
        Term("overhead", OVERHEAD_BYTES if device_bytes else 0, "CUDA context, allocator slack")
    )
    return plan

"""The plan at the start of a run: logged before any weight is loaded; on GPUs, a stop if it will not fit."""

from __future__ import annotations

import logging
from typing import Any

import torch

from glm_training.plan.components import meta_components
from glm_training.plan.device import build_plan
from glm_training.plan.joint import joint_plan
from glm_training.plan.loading import loading_host_plan
from glm_training.plan.report import MemoryPlan, MemoryPlanError, format_gib

logger = logging.getLogger("glm_training")


def check_fits(plan: MemoryPlan) -> None:
    """Raise `MemoryPlanError` naming the largest terms and the fixes when the plan exceeds the device."""
    if plan.fits():
        return
    top = "; ".join(f"{t.name} {format_gib(t.bytes)}" for t in plan.largest())
    raise MemoryPlanError(
        f"this run is predicted to need {format_gib(plan.peak)} per GPU but {format_gib(plan.device_bytes)} "
        f"is available (model.max_memory_fraction of the device). Largest terms: {top}. "
        "Fixes: LoRA (model.lora.enabled=true), "
        "sharding (trainer.strategy=fsdp under torchrun), model.gradient_checkpointing=true, a smaller "
        "sampling.micro_batch_size / algo.micro_batch_size, or a smaller resolution. See "
        "`python -m glm_training.plan --config ...` for the whole table."
    )


def _device_room(cfg: Any, accelerator: Any) -> int | None:
    """`model.max_memory_fraction` of this rank's GPU, or of all GPUs together when a single process spreads
    the model with a device map; None off GPUs."""
    if accelerator.device.type != "cuda":
        return None
    spread = accelerator.num_processes == 1 and cfg.model.device_map in ("auto", "balanced")
    indices = range(torch.cuda.device_count()) if spread else [accelerator.device.index or 0]
    total = sum(torch.cuda.get_device_properties(i).total_memory for i in indices)
    return int(total * cfg.model.max_memory_fraction)


def log_memory_plan(cfg: Any, accelerator: Any, dit_cfg: Any = None) -> MemoryPlan | None:
    """Log the plan at the start of a run; on GPUs, stop before loading if it will not fit. A joint run
    passes its AR half's config as `cfg` (it loads the pipeline) and its DiT half's as `dit_cfg`.

    The room is `model.max_memory_fraction` of this rank's GPU, or of all GPUs together when a single process
    spreads the model with a device map. A model whose configs cannot be read offline (a hub id other than
    zai-org/GLM-Image that is not a local folder) gets a warning, not an error: the plan is advice.
    """
    device_bytes = _device_room(cfg, accelerator)
    plan, loading, error = None, None, None
    world = accelerator.num_processes
    # Rank 0 first: reading the tiny model's configs builds it, and only rank 0 may (see
    # `Policy._resolve_path`). No exception may leave this block: each rank must reach both of its barriers.
    with accelerator.main_process_first():
        try:
            modules = meta_components(cfg.model)  # once, for both tables
            if dit_cfg is None:
                plan = build_plan(cfg, world_size=world, device_bytes=device_bytes, modules=modules)
            else:
                plan = joint_plan(cfg, dit_cfg, world_size=world, device_bytes=device_bytes, modules=modules)
            loading = loading_host_plan(
                cfg, world_size=world, device=accelerator.device.type, modules=modules
            )
        except Exception as err:  # the plan is advice: a model it cannot size still loads
            error = err
    if plan is None:
        logger.warning("[plan] no memory plan for model '%s': %s", cfg.model.name, error)
        return None
    for line in plan.table().splitlines():
        logger.info("[plan] %s", line)
    if loading is None:  # the device plan above still decides whether the run fits
        logger.warning("[plan] no loading plan for model '%s': %s", cfg.model.name, error)
    else:
        for line in loading.table().splitlines():
            logger.info("[plan] %s", line)
    check_fits(plan)
    return plan

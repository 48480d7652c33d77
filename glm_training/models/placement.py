"""Where each GLM-Image component is loaded, and how it gets to the training device.

The rules are the lessons of the project's seed bugs, made structural so the bugs cannot come back:

- Distributed (torchrun, FSDP, DeepSpeed): always load with `device_map="cpu"`, then move explicitly to the
  rank's device, then wrap. A multi-device map under data parallelism is refused by accelerate
  ("You can't train a model that has been loaded with device_map='auto' in any distributed mode").
- Single process: use the configured map (`auto` -> diffusers' `balanced`, since pipelines do not accept
  `auto`), and call `.to()` only when the map is `cpu`. A model placed by a map is already where it
  belongs and may hold meta tensors; `.to()` on it fails with "Cannot copy out of meta tensor".
- Loading never passes `offload_state_dict` / `offload_folder` (seen to hang initialisation); when a map
  spreads over GPUs, `max_memory` is a fraction (default 90%) of each GPU.
- Any tensor still on the meta device after loading is reported by name with a remedy (`MetaTensorError`),
  before anything calls `.to()` on it.
- Every stage runs under a timeout and fails with an error naming the stage instead of hanging silently.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from glm_training.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PlacementError(UserError, RuntimeError):
    """A model cannot be placed as configured; the message says what to change."""


class MetaTensorError(PlacementError):
    """Parameters or buffers are still on the meta device after loading."""


class StageTimeoutError(PlacementError):
    """A loading stage ran past its timeout."""


@dataclass(frozen=True)
class PlacementPlan:
    """How to load: the `device_map` for `from_pretrained`, and where (if anywhere) to move afterwards."""

    distributed: bool
    reason: str
    load_device_map: str  # "cpu", "balanced" or "cuda": the only values diffusers pipelines accept
    move_to: torch.device | None  # None: the map already placed everything; never call .to()
    max_memory: dict[int | str, int] | None = None

    def describe(self) -> str:
        move = f"then .to({self.move_to})" if self.move_to is not None else "no .to() afterwards"
        mode = "distributed" if self.distributed else "single process"
        return f"{mode} ({self.reason}): load with device_map='{self.load_device_map}', {move}"


def plan_placement(
    device_map: str,
    *,
    distributed: bool,
    reason: str,
    device: torch.device,
    max_memory_fraction: float = 0.9,
) -> PlacementPlan:
    """Decide how to load and place the pipeline. Pure: no model is touched.

    Args:
        device_map: the configured map: "auto", "balanced", "cuda" or "cpu".
        distributed: from `distributed.collectives.detect_distributed`; overrides `device_map`.
        reason: why the run is (not) distributed, for the log line.
        device: this process's training device (`distributed.collectives.choose_device`).
        max_memory_fraction: share of each GPU a multi-GPU map may fill.
    """
    if distributed:
        # Each rank holds a full copy on its own device; the engine (DDP/FSDP/DeepSpeed) does the rest.
        return PlacementPlan(True, reason, "cpu", device)
    if device_map == "cpu":
        # Loaded whole on the CPU, so nothing is on meta and moving to the training device is safe.
        return PlacementPlan(False, reason, "cpu", device)
    if device.type != "cuda":
        if device_map == "cuda":
            raise PlacementError(
                "model.device_map='cuda' but this machine has no CUDA device; use model.device_map=auto "
                "(or cpu) to train on the CPU."
            )
        # "auto"/"balanced" with no GPU to balance over: the CPU is the only device, and loading there *is*
        # the placement, so there is nothing to move.
        return PlacementPlan(
            False, f"{reason}; no GPU, so '{device_map}' places everything on the CPU", "cpu", None
        )
    if device_map in ("auto", "balanced"):
        max_memory: dict[int | str, int] = {
            i: int(torch.cuda.get_device_properties(i).total_memory * max_memory_fraction)
            for i in range(torch.cuda.device_count())
        }
        return PlacementPlan(False, reason, "balanced", None, max_memory)
    return PlacementPlan(False, reason, device_map, None)


def pipeline_load_kwargs(plan: PlacementPlan, torch_dtype: torch.dtype) -> dict[str, Any]:
    """Keyword arguments for `GlmImagePipeline.from_pretrained`. Never any offloading options."""
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "device_map": plan.load_device_map}
    if plan.max_memory is not None:
        kwargs["max_memory"] = plan.max_memory
    return kwargs


def meta_tensors(module: nn.Module) -> list[str]:
    """Names of parameters and buffers of `module` that are still on the meta device."""
    names = [n for n, p in module.named_parameters() if p.device.type == "meta"]
    names += [n for n, b in module.named_buffers() if b.device.type == "meta"]
    return names


def check_no_meta(components: Mapping[str, nn.Module], *, num_shown: int = 5) -> None:
    """Raise `MetaTensorError` naming the first few meta tensors of any component, with the remedy."""
    problems = []
    for name, module in components.items():
        found = meta_tensors(module)
        if found:
            shown = ", ".join(found[:num_shown]) + (
                f", ... ({len(found)} in all)" if len(found) > num_shown else ""
            )
            problems.append(f"{name}: {shown}")
    if problems:
        raise MetaTensorError(
            "These weights are still on the meta device after loading (they were never materialised, e.g. "
            "offloaded by a device map or missing from the checkpoint): "
            + "; ".join(problems)
            + ". Remedy: load with model.device_map=cpu (or run distributed, which always loads on CPU), "
            "give the GPUs more room (model.max_memory_fraction), or check that the checkpoint is complete. "
            "Moving such a model with .to() would fail with 'Cannot copy out of meta tensor'."
        )


def move_to_device(components: Mapping[str, nn.Module], device: torch.device) -> None:
    """`.to(device)` for each component, after proving none holds meta tensors."""
    check_no_meta(components)
    for module in components.values():
        module.to(device)


def run_stage(name: str, fn: Callable[[], T], timeout_s: float) -> T:
    """Run one loading stage, logging its start and duration; fail with the stage's name on timeout.

    The work runs in a daemon thread so a stage that hangs inside a library cannot hang the run: after
    `timeout_s` the error names the stage and shows where the stuck thread was.
    """
    result: dict[str, Any] = {}
    # The CUDA device is per thread: the stage's thread uses the caller's (a collective in the stage, such as
    # reading shards, must run on this rank's GPU, not on cuda:0).
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def target() -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            result["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    logger.info("[load] %s ...", name)
    start = time.perf_counter()
    thread = threading.Thread(target=target, name=f"stage:{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        frame = sys._current_frames().get(thread.ident or -1)
        where = "".join(traceback.format_stack(frame)[-3:]) if frame is not None else "(unknown)\n"
        raise StageTimeoutError(
            f"Loading stage '{name}' did not finish within {timeout_s:.0f} s (model.stage_timeout_s). "
            f"It was stuck at:\n{where}"
            "Check disk and network access to the checkpoint, or raise model.stage_timeout_s for a slow "
            "file system."
        )
    if "error" in result:
        raise result["error"]
    logger.info("[load] %s done in %.1f s", name, time.perf_counter() - start)
    return result["value"]


def describe_module(name: str, module: nn.Module) -> str:
    """One log line: where a component landed, its dtype(s) and its parameter counts.

    A component that trains also says how much of it this rank holds, `(<N> local of <M> trainable
    params)` in M's unit: all of it unsharded, about 1/world under FSDP (`distributed/sharding.py`).
    """
    devices = sorted({str(p.device) for p in module.parameters()} or {"(no parameters)"})
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()} or {"-"})
    total = sum(p.numel() for p in module.parameters())
    local, trainable = trainable_counts(module)
    counts = (
        f"{_human(local, trainable)} local of {_human(trainable)} trainable params" if trainable else "frozen"
    )
    return (
        f"{name}: device {','.join(devices)} | dtype {','.join(dtypes)} | {_human(total)} params ({counts})"
    )


def _human(n: int, scale: int | None = None) -> str:
    """`n` with the unit that suits `scale` (default `n` itself), so that two counts compare at a glance."""
    scale = n if scale is None else scale
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if scale >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def parse_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def local_numel(param: torch.Tensor) -> int:
    """Elements of `param` this rank holds (its shard under FSDP2, all of it otherwise)."""
    from torch.distributed.tensor import DTensor

    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def trainable_counts(module: nn.Module) -> tuple[int, int]:
    """(elements of the trainable parameters held by this rank, elements of the trainable parameters)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return sum(local_numel(p) for p in params), sum(p.numel() for p in params)

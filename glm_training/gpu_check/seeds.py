"""The lessons of the project's four seed bugs as pass/fail checks, run on the device through the project's
own code (`models/placement.py`, `models/wrapper.py`, `distributed/collectives.py`) on a tiny GLM-Image:

- 000: a single process loads with a device map and never calls `.to()` on a placed model; a module with
  meta tensors is refused by name;
- 001: a distributed-style load lands on `cuda:LOCAL_RANK` (the CPU where there is no CUDA);
- 002: loading takes no offloading options, a stuck stage stops with its name, and the AR model's
  `pad_token_id` is set without reloading;
- 003: dynamic sampling's gather ends on this rank's device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.gpu_check.settings import Settings

logger = logging.getLogger("glm_training.gpu_check")


@contextlib.contextmanager
def counting_moves() -> Iterator[list[str]]:
    """Record every `placement.move_to_device` call (the one `.to()` of a loaded pipeline) in the block."""
    from glm_training.models import placement

    calls: list[str] = []
    original = placement.move_to_device

    def spy(components, device):
        calls.append(str(device))
        return original(components, device)

    placement.move_to_device = spy
    try:
        yield calls
    finally:
        placement.move_to_device = original


def _devices(wrapper) -> set[str]:
    return {str(p.device) for m in wrapper.components().values() for p in m.parameters()}


def run_checks(settings: Settings, folder: Path) -> list[dict[str, Any]]:
    """The four seed write-ups as pass/fail checks, on a tiny GLM-Image saved in `folder`."""
    from glm_training.config import load_config

    model_cfg = load_config(config="t2i_training").model  # model=tiny, device_map=auto
    checks = []
    for seed, name, fn in (
        ("000", "single process: device map, no .to() on a placed model", _check_single_process),
        ("001", "distributed-style load lands on cuda:LOCAL_RANK", _check_distributed),
        ("002", "loading: no offloading options, stages bounded", _check_loading_bounded),
        ("003", "dynamic-sampling gather ends on this rank's device", _check_gather),
    ):
        logger.info("[gpu_check]   check %s: %s", seed, name)
        try:
            passed, message = fn(settings, model_cfg, folder)
        except Exception as err:  # a check that raises has failed; the message says how
            passed, message = False, f"raised {type(err).__name__}: {err}"
        checks.append({"seed": seed, "name": name, "passed": passed, "message": message})
        logger.info("[gpu_check]   %s: %s", "pass" if passed else "FAIL", message)
    return checks


def _check_single_process(settings: Settings, model_cfg, folder: Path) -> tuple[bool, str]:
    from glm_training.models.placement import MetaTensorError, move_to_device
    from glm_training.models.wrapper import load_for_training

    with counting_moves() as moves:
        wrapper, plan = load_for_training(
            model_cfg,
            "dit",
            distributed=False,
            reason="gpu_check",
            device=settings.device,
            model_path=str(folder),
        )
    devices = _devices(wrapper)
    expected_map = "balanced" if settings.device.type == "cuda" else "cpu"
    ok = plan.load_device_map == expected_map and plan.move_to is None and not moves
    ok &= all(d.startswith(settings.device.type) for d in devices)
    # A module with meta tensors is refused by name, with the remedy, before any .to() is attempted.
    try:
        move_to_device({"meta_linear": nn.Linear(2, 2, device="meta")}, settings.device)
        refused = False
    except MetaTensorError:
        refused = True
    message = (
        f"{plan.describe()}; components on {sorted(devices)}; move_to_device calls: {len(moves)}; "
        f"a meta module is refused by name: {refused}"
    )
    return ok and refused, message


def _check_distributed(settings: Settings, model_cfg, folder: Path) -> tuple[bool, str]:
    from glm_training.distributed.collectives import choose_device, detect_distributed, rank_info, same_device
    from glm_training.models.wrapper import load_for_training

    # The project's rule (`choose_device`) decides, not --device: with CUDA present a rank uses its GPU.
    local_rank = max(torch.cuda.device_count() - 1, 0)
    env = {"LOCAL_RANK": str(local_rank), "WORLD_SIZE": "1"}
    distributed, reason = detect_distributed(env)
    device = choose_device(rank_info(env).local_rank)
    with counting_moves() as moves:
        wrapper, plan = load_for_training(
            model_cfg, "dit", distributed=distributed, reason=reason, device=device, model_path=str(folder)
        )
    devices = _devices(wrapper)
    expected = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    ok = distributed and same_device(device, expected) and plan.load_device_map == "cpu"
    ok &= moves == [str(device)] and all(same_device(d, expected) for d in devices)
    return ok, f"env {env}: {plan.describe()}; components on {sorted(devices)}; expected {expected}"


def _check_loading_bounded(settings: Settings, model_cfg, folder: Path) -> tuple[bool, str]:
    from glm_training.distributed.collectives import choose_device
    from glm_training.models.placement import (
        StageTimeoutError,
        pipeline_load_kwargs,
        plan_placement,
        run_stage,
    )
    from glm_training.models.wrapper import GLMImageWrapper

    offloading = []
    for distributed in (False, True):
        plan = plan_placement("auto", distributed=distributed, reason="gpu_check", device=choose_device(0))
        offloading += [k for k in pipeline_load_kwargs(plan, torch.float32) if "offload" in k]
    start = time.perf_counter()
    try:
        run_stage("gpu_check stuck stage", lambda: time.sleep(1.0), timeout_s=0.1)
        timed_out = False
    except StageTimeoutError as err:
        timed_out = "gpu_check stuck stage" in str(err)
    waited = time.perf_counter() - start
    wrapper = GLMImageWrapper(
        str(folder), "dit", device_map="auto" if settings.device.type == "cuda" else "cpu"
    )
    pad = wrapper.pipeline.vision_language_encoder.generation_config.pad_token_id
    ok = not offloading and timed_out and waited < 0.9 and pad is not None
    return ok, (
        f"offloading load options: {offloading or 'none'}; a stuck stage stops with its name after "
        f"{waited:.2f} s: {timed_out}; AR pad_token_id set without reloading: {pad}"
    )


def _check_gather(settings: Settings, model_cfg, folder: Path) -> tuple[bool, str]:
    """Dynamic sampling's exchange (`algorithms/grpo/dynamic_sampling.py`): rollout records (CPU) plus
    reward tensors on the device, gathered by `distributed.collectives.gather_objects` through a real
    collective (a one-process group made here), then stacked.
    The trainer gathers its records to the CPU; the check asks for the device, where a tensor left on the
    sender's device would show."""
    from diffusers import GlmImagePipeline

    from glm_training.algorithms.grpo.log_probs import split_samples
    from glm_training.distributed import collectives as dist
    from glm_training.pipeline.ar import sample_image_tokens
    from glm_training.pipeline.ar_logits import SamplingParams

    pipe = GlmImagePipeline.from_pretrained(str(folder)).to(settings.device)
    samples = sample_image_tokens(pipe, ["a", "b"], 32, 32, SamplingParams.from_pipeline(pipe), seed=0)
    records = split_samples(samples)
    for i, record in enumerate(records):
        record["parts"] = {"reward": torch.tensor(float(i), device=settings.device)}
    # gather_objects skips the collective in a single process without a group: make one.
    with dist.one_process_group(settings.device):
        everyone = dist.flatten(dist.gather_objects(records, device=settings.device))
    devices = {
        str(v.device) for r in everyone for v in [*r.values(), *r["parts"].values()] if torch.is_tensor(v)
    }
    stacked = torch.stack([r["parts"]["reward"] for r in everyone])  # the seed's failing line
    ok = all(dist.same_device(d, settings.device) for d in devices) and len(everyone) == len(records)
    return (
        ok,
        f"{len(everyone)} records gathered, tensors on {sorted(devices)}; stacked on {stacked.device}",
    )

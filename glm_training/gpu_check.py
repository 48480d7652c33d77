"""One-command check of the GPU path: speed, memory and placement of GLM-Image at its real depth.

    python -m glm_training.gpu_check [--device cuda|cpu] [--toy] [--output DIR] [--sections NAME ...]

Made for one 80 GB GPU: every section takes about 5.5 minutes on one H100 (docs/benchmarks.md). It downloads
nothing and writes, under `--output`, `gpu_check.jsonl` (one line per finished stage, flushed and synced at
once, so that a run stopped at a time limit keeps every finished stage), `gpu_check.json` (everything) and
`gpu_check.md` (the tables for docs/benchmarks.md, targets first); a temporary folder it removes holds a
1 MB tiny GLM-Image for the seed checks and the trainers' config and metrics files. It exits 1 when a check
fails or a stage raises. After the environment (device, driver, versions, measured copy bandwidth and matmul
throughput), the sections in order of value (`SECTIONS`; `--sections` picks some):

1. `seeds`: the lessons of the project's four seed bugs, checked on the device through the project's own code
   (`models/placement.py`, `models/wrapper.py`, `distributed.py`) on the tiny model;
2. then GLM-Image is built at the real depth (40 AR layers, 40 vision layers, 30 DiT blocks, 12 glyph
   layers; the widths of `models/shape.py`) with random weights directly on the device: each component is
   created on the meta device, materialised with `to_empty` and filled by a seeded deterministic init (no
   round trip through disk); a forward of the AR model must give finite logits;
3. `dit`: one Flow-GRPO LoRA step of the DiT (`DiTTrainer`, `recipes/flow_grpo_fast_ocr`): seconds, MFU, peak
   memory next to `glm_training.plan`'s prediction; its prior tokens are seeded random codebook ids, as a
   prior cache (`data.prior_cache`) hands them over, so the step times the DiT alone;
4. `ar`: one GRPO/DAPO LoRA step of the AR model (`ARTrainer`, `recipes/dapo_aesthetic_alignment`): seconds
   and peak memory next to the plan;
5. `decoding`: AR decoding tokens/s over a fixed number of steps (`rollout.ar.decode_first_tokens`) at each
   batch size, for every path in `DECODING_PATHS` (or those `--decoding` names) and, with `--compile`
   (default on CUDA), the loop's compiled step (CUDA graphs), next to the memory-bandwidth roofline;
6. `pipeline`: one text-to-image call at each size: the project's decoding loop (compiled where it compiled
   in 5) writes the prior tokens, the pipeline's DiT and VAE turn them into pixels.

`--toy` keeps one layer per stack (the real widths: the `model=glm_image_shape` fixture's layout) and 64x64
images, so the same code runs on a CPU (in float32 where the CPU has no native bf16).

Weights: biases 0, norm scales 1, every other parameter N(0, 0.02) values. To fill billions of them in seconds
on any device, one seeded block of 2^20 - 3 normal values (a prime length) is tiled through each tensor from a
per-tensor offset: rows of a matrix are distinct windows of the block, which keeps activations and logits in
their usual range (the build checks the logits).

Training steps: the trainers are the project's own, built from the real-model recipes (`model=glm_image_shape`
with `--toy`) with one group of two samples, the JPEG reward (no reward weights to download) and the bundled
prompts; `--dit-overrides` / `--ar-overrides` add config overrides. Only where the model comes from differs:
`_build_model` hands over the pipeline built here instead of loading a folder, so nothing is written to disk;
the checkpoint at the end of the step is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("glm_training.gpu_check")

GIB = 1024**3
PROMPT = 'A red apple on a wooden table, a sign reading "GLM" behind it, soft studio light'
PACKAGES = ("torch", "transformers", "diffusers", "peft", "accelerate")
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (FLOP/s), matched in order against the device name.
SPEC_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("B200", 2250e12),
)
# One step of one group of two samples, the bundled prompts (`data.prompt_file=`), a reward without weights.
COMMON_OVERRIDES = [
    "data.prompt_file=",
    "reward.names=[jpeg_compressibility]",
    "data.num_groups_per_step=1",
    "data.num_generations=2",
    "eval.every_n_steps=0",
    "trainer.num_steps=1",
    "logging.tensorboard=false",
    "trainer.progress_bar=false",
]


@dataclass(frozen=True)
class Settings:
    """What one check run measures, resolved once from the command line."""

    device: torch.device
    dtype: torch.dtype
    toy: bool
    sections: tuple[str, ...]  # SECTIONS to run, in their order
    sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    decoding_paths: tuple[str, ...]  # the AR decoding paths to time (default: every one)
    decode_steps: int
    compile: bool
    num_inference_steps: int
    train_size: int
    output: Path
    overrides: dict[str, list[str]] = field(default_factory=dict)  # per half: --dit-overrides, --ar-overrides
    seed: int = 0
    layers: dict[str, int] = field(default_factory=dict)  # ar, vision, dit, glyph


# ---------------------------------------------------------------------------------------------------------
# Devices: synchronisation, peak memory, the environment


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[dict[str, Any]]:
    """Yield a dict that holds, after the block, its `seconds` (device synchronised) and `peak_memory_gib`.

    Peak memory on CUDA: `max_memory_allocated` after `reset_peak_memory_stats`. On the CPU: the process's
    peak RSS (`resource.getrusage`), reset at the start by writing 5 to /proc/self/clear_refs (Linux); where
    that reset is refused, the figure is the peak since the process started and `peak_memory_source` says so.
    """
    out: dict[str, Any] = {"peak_memory_source": "torch.cuda.max_memory_allocated"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            out["peak_memory_source"] = "peak RSS (getrusage, reset per stage)"
        except OSError:
            out["peak_memory_source"] = "peak RSS since process start (getrusage; no reset on this OS)"
    synchronize(device)
    start = time.perf_counter()
    try:
        yield out
    finally:
        synchronize(device)
        out["seconds"] = time.perf_counter() - start
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # ru_maxrss: bytes on macOS, KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (
                1 if sys.platform == "darwin" else 1024
            )
        out["peak_memory_gib"] = peak / GIB


def environment(device: torch.device) -> dict[str, Any]:
    """Device name, driver, CPU model and the package versions the figures were taken with."""
    from glm_training.environment import cpu_has_native_bf16, cpu_model

    info: dict[str, Any] = {
        "device": str(device),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_gib=props.total_memory / GIB,
            cuda_runtime=torch.version.cuda,
            driver_version=_nvidia_driver_version(),
        )
    else:
        info["device_name"] = f"CPU: {info['cpu_model']}"
    return info


def _nvidia_driver_version() -> str | None:
    """From nvidia-smi when it is on PATH (torch does not expose the driver's version)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed calls after one warm-up: the machine's capability, not its noise
    (another process sharing the CPU only ever slows a call down)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(device: torch.device) -> dict[str, Any]:
    """Memory bandwidth: a copy on the device (1 GiB on CUDA, 256 MiB on the CPU); read + write bytes / s."""
    numel = (GIB if device.type == "cuda" else 256 * 1024**2) // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats=10)
    return {"copy_bytes": numel * 4, "seconds_per_copy": seconds, "bytes_per_s": 2 * numel * 4 / seconds}


def measure_matmul(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Achievable matmul throughput in the compute dtype (8192^3 on CUDA, 1024^3 on the CPU), FLOP/s."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: a @ b, device, repeats=10 if device.type == "cuda" else 3)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "flops_per_s": 2 * n**3 / seconds}


def spec_peak_flops(device_name: str) -> float | None:
    return next((flops for key, flops in SPEC_BF16_FLOPS if key in device_name), None)


# ---------------------------------------------------------------------------------------------------------
# 1. The model, built on the device


def build_pipeline(settings: Settings):
    """GLM-Image with `settings.layers` layers per stack, random weights, built on `settings.device`
    (`shape.build_components`: meta device, then materialised there and seeded)."""
    from glm_training.models import shape

    built = shape.build_components(settings.layers, settings.device, settings.dtype, settings.seed)
    for name, module in built.items():
        logger.info("[gpu_check]   %s: %.2fB parameters", name, _numel(module) / 1e9)
    pipe = shape.finish_shape_pipeline(**built)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def ar_logits_check(pipe, device: torch.device) -> dict[str, Any]:
    """One AR forward on the prompt: its next-token logits must be finite (the init is numerically sane)."""
    from glm_training.rollout.ar import chat_inputs

    inputs = chat_inputs(pipe, [PROMPT], 512, 512)
    out = pipe.vision_language_encoder(**{k: v.to(device) for k, v in inputs.items()}, logits_to_keep=1)
    logits = out.logits.float()
    return {"finite": bool(torch.isfinite(logits).all()), "logits_std": float(logits.std())}


# ---------------------------------------------------------------------------------------------------------
# 2. Speed: the pipeline's own call, the AR rollout against its roofline


def time_text_to_image(
    pipe, size: int, num_steps: int, device: torch.device, compile: bool
) -> dict[str, Any]:
    """One text-to-image call: the project's decoding loop writes the prior tokens (`sample_image_tokens`,
    compiled when `compile`), then `pipe(prompt=..., prior_token_ids=...)` runs the DiT and the VAE.

    Seconds of each half and in all, peak memory, finite pixels. Where the compiled step had to compile or
    capture its graph during the timed call (`graphs_compiled`), the AR half is timed once more, warm.
    """
    from glm_training.rollout.ar import SamplingParams, sample_image_tokens

    params = SamplingParams.from_pipeline(pipe)

    def ar_half() -> tuple[Any, dict[str, Any], int]:
        graphs = _compiled_graphs()
        with measured(device) as ar:
            samples = sample_image_tokens(pipe, [PROMPT], size, size, params, seed=0, compile=compile)
        return samples, ar, _compiled_graphs() - graphs

    samples, ar, compiled = ar_half()
    if compile and compiled:
        samples, ar, _ = ar_half()
    generator = torch.Generator(device=device).manual_seed(0)
    with measured(device) as dit:
        images = pipe(
            prompt=PROMPT,
            prior_token_ids=samples.prior_token_ids.to(device),
            height=size,
            width=size,
            num_inference_steps=num_steps,
            generator=generator,
            output_type="np",
        ).images
    finite = bool(torch.isfinite(torch.as_tensor(images)).all())
    return {
        "height": size,
        "width": size,
        "num_inference_steps": num_steps,
        "decoding": "loop+compile" if compile else "loop",
        "ar_tokens": int(samples.completion_mask.sum()) + 1,
        "ar_seconds": ar["seconds"],
        "graphs_compiled_in_first_ar_call": compiled,
        "dit_seconds": dit["seconds"],
        "seconds": ar["seconds"] + dit["seconds"],
        "peak_memory_gib": max(ar["peak_memory_gib"], dit["peak_memory_gib"]),
        "peak_memory_source": dit["peak_memory_source"],
        "finite": finite,
    }


def _compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def decode_bytes_per_step(model: nn.Module, batch: int, context: float) -> dict[str, float]:
    """Bytes one decoding step reads at best: every text-model weight it uses, once, plus the KV cache.

    Weights: the decoder layers, final norm and `lm_head` (the vocabulary embedding contributes only the
    `batch` rows it looks up; the vision tower and VQ model are not run). KV cache: keys and values of every
    layer at `context` positions per sample, in the model's dtype.
    """
    decoder = model.get_decoder()
    text = model.config.get_text_config(decoder=True)
    embed = decoder.get_input_embeddings()
    elem = next(decoder.parameters()).element_size()
    weights = (_numel(decoder) - _numel(embed) + _numel(model.lm_head) + batch * embed.embedding_dim) * elem
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = batch * context * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * elem
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def time_decoding(
    pipe,
    decoding: str,
    compile: bool,
    size: int,
    batch: int,
    num_steps: int,
    bandwidth: float | None,
    device: torch.device,
) -> dict[str, Any]:
    """Decoding speed over the first `num_steps` steps of a `size`² rollout of `batch` prompts, next to its
    memory-bandwidth roofline (`decode_first_tokens`).

    Two timed calls, one draw (the prefill's) and `num_steps` draws; their difference is `num_steps - 1`
    decoding steps without the prefill: tokens/s = batch x (num_steps - 1) / that difference. With `compile`
    a first call compiles the step and captures its graph (`compile_seconds`). Roofline: `batch` tokens a
    step, a step reading `decode_bytes_per_step` at the measured copy bandwidth; the loop reads its whole
    preallocated cache, generate() its cache at the mean context length.
    """
    from glm_training.rollout.ar import SamplingParams, chat_inputs, decode_first_tokens

    params = SamplingParams.from_pipeline(pipe)
    prompts = [PROMPT] * batch
    out: dict[str, Any] = {}

    def run(steps: int) -> None:
        decode_first_tokens(pipe, prompts, size, size, params, 0, steps, decoding=decoding, compile=compile)

    if compile:
        with measured(device) as first:
            run(4)  # compiles, then warms up and captures the CUDA graph
        out["compile_seconds"] = first["seconds"]
    graphs = _compiled_graphs()
    with measured(device) as prefill:
        run(1)
    with measured(device) as m:
        run(num_steps)
    inputs = chat_inputs(pipe, prompts, size, size)
    num_prompt = inputs["input_ids"].shape[1]
    num_grid = sum(int(t * h * w) for t, h, w in inputs["image_grid_thw"].tolist()) // batch
    context = num_prompt + num_grid + 1 if decoding == "loop" else num_prompt + (num_steps - 1) / 2
    read = decode_bytes_per_step(pipe.vision_language_encoder, batch, context)
    seconds = m["seconds"] - prefill["seconds"]
    speed = batch * (num_steps - 1) / seconds if seconds > 0 else float("nan")
    roofline = batch * bandwidth / read["total"] if bandwidth else None
    return {
        "decoding": f"{decoding}+compile" if compile else decoding,
        "height": size,
        "width": size,
        "batch": batch,
        "num_steps": num_steps,
        "prompt_tokens": num_prompt,
        "prefill_seconds": prefill["seconds"],
        "seconds": m["seconds"],
        "step_ms": 1000 * seconds / (num_steps - 1),
        "tokens_per_s": speed,
        "bytes_per_step": read,
        "roofline_tokens_per_s": roofline,
        "ratio": speed / roofline if roofline else None,
        "graphs_compiled": _compiled_graphs() - graphs,
        "peak_memory_gib": max(prefill["peak_memory_gib"], m["peak_memory_gib"]),
        **out,
    }


# ---------------------------------------------------------------------------------------------------------
# 3. The seed bugs, checked on the device through the project's own placement and collectives


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
    from glm_training.distributed import choose_device, detect_distributed, rank_info, same_device
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
    from glm_training.distributed import choose_device
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
    """ARTrainer._collect's exchange: rollout records (CPU) plus reward tensors on the device, gathered by
    `distributed.gather_objects` through a real collective (a one-process group made here), then stacked.
    The trainer gathers its records to the CPU; the check asks for the device, where a tensor left on the
    sender's device would show."""
    from diffusers import GlmImagePipeline

    from glm_training import distributed as dist
    from glm_training.rollout.ar import SamplingParams, sample_image_tokens, split_samples

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


# ---------------------------------------------------------------------------------------------------------
# The training steps: the project's trainers around the in-memory pipeline


def _in_memory(trainer_cls: type) -> type:
    """`trainer_cls` whose model is a given pipeline (no folder, no `.to()`), with the rollout and the update
    timed and their peak memory measured, and no checkpoint written."""
    from glm_training.models.wrapper import GLMImageWrapper
    from glm_training.trainers.diffusion_trainer import DiffusionTrainer

    class InMemory(trainer_cls):
        def __init__(self, cfg, pipeline) -> None:
            self.given_pipeline = pipeline
            self.phases: dict[str, dict[str, float]] = {}
            super().__init__(cfg)

        def _build_model(self) -> GLMImageWrapper:
            self.prior_cache = None  # DiffusionTrainer's: the AR model samples the prior tokens
            wrapper = GLMImageWrapper.from_pipeline(self.given_pipeline, self.component)
            self.device = next(wrapper.trainable.parameters()).device
            return wrapper

        def _timed(self, phase: str, fn: Callable[[], Any]) -> Any:
            with measured(self.device) as self.phases[phase]:
                return fn()

        def _collect(self, step: int):
            return self._timed("rollout", lambda: super(InMemory, self)._collect(step))

        def _update(self, batch, step: int) -> dict[str, float]:
            self.update_stats = self._timed("update", lambda: super(InMemory, self)._update(batch, step))
            return self.update_stats

        def _save(self, step: int, at_once: bool = True) -> None:
            pass  # the check writes no checkpoint

    if issubclass(trainer_cls, DiffusionTrainer):
        InMemory._shared_prior_tokens = _random_prior_tokens
    InMemory.__name__ = f"InMemory{trainer_cls.__name__}"
    return InMemory


def _random_prior_tokens(trainer, group_prompts: list, step: int) -> torch.Tensor:
    """The DiT step's prior tokens: seeded random codebook ids, as a prior cache (`data.prior_cache`) would
    hand them over, so that the step times the DiT alone (the AR step times the AR rollout)."""
    s = trainer.cfg.sampling
    vocab = int(trainer.wrapper.pipeline.transformer.config.prior_vq_quantizer_codebook_size)
    generator = torch.Generator().manual_seed(trainer.sample_seed(step))
    return torch.randint(vocab, (len(group_prompts), (s.height // 16) * (s.width // 16)), generator=generator)


def training_config(component: str, settings: Settings, output_dir: Path):
    """The recipe of `component`'s half, shrunk to one step of one group of two samples (module docstring)."""
    from glm_training.config import load_config

    size = settings.train_size
    overrides = [
        *COMMON_OVERRIDES,
        f"trainer.output_dir={output_dir}",
        f"sampling.height={size}",
        f"sampling.width={size}",
    ]
    bf16 = settings.dtype == torch.bfloat16
    if settings.toy:
        overrides += ["model=glm_image_shape"]
    overrides += [
        f"model.dtype={'bfloat16' if bf16 else 'float32'}",
        f"trainer.mixed_precision={'bf16' if bf16 else 'no'}",
    ]
    if component == "dit":
        recipe = "recipes/flow_grpo_fast_ocr"
        if settings.toy:
            overrides += [
                "sampling.num_steps=2",
                "sampling.sde_window_size=1",
                "sampling.sde_window_range=[0,1]",
            ]
    else:
        recipe = "recipes/dapo_aesthetic_alignment"
        overrides += ["algo.micro_batch_size=2"] + (["sampling.dit_num_steps=1"] if settings.toy else [])
    overrides += settings.overrides.get(component, [])
    return recipe, load_config(config=recipe, overrides=overrides)


def train_step(
    component: str, pipe, settings: Settings, matmul_flops: float | None, spec_flops: float | None
) -> dict[str, Any]:
    """One training step of `component`'s half through its trainer: times, peak memory, the plan's figure."""
    from glm_training.models.lora import merge_lora_adapters, tuner_layers
    from glm_training.trainers.ar_trainer import ARTrainer
    from glm_training.trainers.dit_trainer import DiTTrainer

    trainer_cls = _in_memory(DiTTrainer if component == "dit" else ARTrainer)
    attribute = "transformer" if component == "dit" else "vision_language_encoder"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        recipe, cfg = training_config(component, settings, Path(tmp) / "run")
        trainer = None
        try:
            trainer = trainer_cls(cfg, pipe)
            graphs = _compiled_graphs()
            with measured(settings.device) as step:
                trainer.train()
            graphs = _compiled_graphs() - graphs
            record = json.loads((trainer.output_dir / "metrics.jsonl").read_text().splitlines()[-1])
            plan = trainer.memory_plan
            phases = trainer.phases
            result = {
                "component": component,
                "recipe": recipe,
                "driven_by": f"{trainer_cls.__name__}.train(), 1 step",
                "height": settings.train_size,
                "width": settings.train_size,
                "samples": cfg.data.per_rank_samples(1),
                "step_seconds": step["seconds"],
                "phases": phases,
                # Each phase resets the peak counter as it starts: the step's peak is the largest.
                "peak_memory_gib": max(p["peak_memory_gib"] for p in [step, *phases.values()]),
                "peak_memory_source": step["peak_memory_source"],
                "loss": record.get("loss"),
                "plan_peak_gib": plan.peak / GIB if plan else None,
                "plan_summary": plan.summary() if plan else None,
                "trainable_params": sum(p.numel() for p in trainer.trainable.parameters() if p.requires_grad),
                "graphs_compiled": graphs,
            }
            if component == "dit":
                seconds = phases["update"]["seconds"]
                result.update(dit_update_flops(trainer, pipe, seconds, matmul_flops, spec_flops))
            return result
        finally:
            # Hand the pipeline back as it was: no autocast wrapper, no adapters, no checkpointing, frozen.
            module = getattr(pipe, attribute)
            if trainer is not None:
                module = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
            if tuner_layers(module):
                merge_lora_adapters(module, merge=False)
            # (flag, switch) of diffusers' gradient checkpointing, then transformers' activation checkpointing
            for flag, off in (
                ("is_gradient_checkpointing", "disable_gradient_checkpointing"),
                ("is_activation_checkpointing", "activation_checkpointing_disable"),
            ):
                if hasattr(module, off) and getattr(module, flag, False):
                    getattr(module, off)()
            module.requires_grad_(False).eval()
            pipe.register_modules(**{attribute: module})
            del trainer
            _free(settings.device)


def dit_update_flops(
    trainer, pipe, seconds: float, matmul_flops: float | None, spec_flops: float | None
) -> dict[str, Any]:
    """Model FLOPs of the DiT update and its MFU.

    FLOPs = tokens x N x (4 per policy forward: 2 forward + 2 for the input gradients of the frozen weights;
    2 per reference forward), N = the DiT's matmul weights (every nn.Linear), tokens = latent tokens of an
    image.
    Policy forwards = samples x trained steps x inner epochs, x2 with guidance (CFG's second pass); reference
    forwards the same when beta > 0. LoRA's own gradients, attention scores and the recompute of gradient
    checkpointing are left out: a lower bound of the work done, so the MFU is too.
    """
    cfg = trainer.cfg
    dit = pipe.transformer
    n = sum(m.weight.numel() for m in dit.modules() if isinstance(m, nn.Linear))
    patch = dit.config.patch_size * pipe.vae_scale_factor
    tokens = (cfg.sampling.height // patch) * (cfg.sampling.width // patch)
    cfg_passes = 2 if cfg.sampling.guidance_scale > 1 else 1
    steps = int(trainer.update_stats.get("num_train_steps", 0))
    forwards = cfg.data.per_rank_samples(1) * steps * cfg.algo.num_inner_epochs * cfg_passes
    flops = forwards * tokens * n * (4 + (2 if cfg.algo.beta > 0 else 0))
    achieved = flops / seconds
    return {
        "update_flops": flops,
        "update_flops_per_s": achieved,
        "mfu": achieved / spec_flops if spec_flops else None,
        "of_measured_matmul": achieved / matmul_flops if matmul_flops else None,
    }


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# The run: stages, reports


class Report:
    """The results so far; each stage is timed, logged as it starts and ends, and saved when it ends.

    `gpu_check.jsonl` gets one line a finished stage, flushed and synced to disk at once, so that a run cut
    off at its time limit still leaves every finished stage behind; `gpu_check.json` (everything so far) and
    `gpu_check.md` (the tables) are rewritten after each stage.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        sections = ("stages", "errors", "checks", "pipeline", "decoding")
        self.data: dict[str, Any] = {**{name: [] for name in sections}, "training": {}}
        self.started = time.perf_counter()
        settings.output.mkdir(parents=True, exist_ok=True)
        self.lines = settings.output / "gpu_check.jsonl"
        self.lines.write_text("")

    @contextlib.contextmanager
    def stage(self, name: str, section: str, fatal: bool = False) -> Iterator[dict[str, Any]]:
        """Run a stage, yielding the dict its results go in; an exception is recorded (and logged) and the
        run goes on, unless `fatal`."""
        logger.info("[gpu_check] %s ...", name)
        start = time.perf_counter()
        result: dict[str, Any] = {}
        line: dict[str, Any] = {"section": section, "stage": name, "ok": True}
        try:
            yield result
        except Exception as err:  # recorded: the report says which stage failed and why
            line["ok"] = False
            line["error"] = f"{type(err).__name__}: {err}"
            self.data["errors"].append(
                {"stage": name, "error": line["error"], "traceback": traceback.format_exc()[-4000:]}
            )
            logger.error("[gpu_check] %s FAILED: %s: %s", name, type(err).__name__, err)
            _free(self.settings.device)
            if fatal:
                raise
        finally:
            line["seconds"] = time.perf_counter() - start
            self.data["stages"].append({"name": name, "seconds": line["seconds"], "ok": line["ok"]})
            if line["ok"]:
                logger.info("[gpu_check] %s done in %.1f s", name, line["seconds"])
            self.append_line({**line, "result": result})
            self.write()

    def append_line(self, line: dict[str, Any]) -> None:
        line["wall_seconds"] = time.perf_counter() - self.started
        with self.lines.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @property
    def passed(self) -> bool:
        return not self.data["errors"] and all(c["passed"] for c in self.data["checks"])

    def write(self) -> None:
        self.data["wall_seconds"] = time.perf_counter() - self.started
        self.data["passed"] = self.passed
        out = self.settings.output
        (out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (out / "gpu_check.md").write_text(render_markdown(self.data))


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _table(header: str, rows: list[str]) -> list[str]:
    """Markdown table lines from "a | b:" strings (a header name ending in ':' right-aligns its column)."""
    names = [h.strip() for h in header.split("|")]
    rule = "|".join("---:" if n.endswith(":") else "---" for n in names)
    return [f"| {' | '.join(n.rstrip(':') for n in names)} |", f"|{rule}|", *(f"| {row} |" for row in rows)]


# The targets on one H100: SGLang's 1024² call (AR 31.8 s + 30 DiT steps 14.0 s) and the vendor's
# (diffusers, 50 steps) 64.3 s / 37.8 GB.
SGLANG_SECONDS, SGLANG_DIT_STEPS = 45.8, 30
VENDOR_SECONDS, VENDOR_PEAK_GB = 64.3, 37.8


def target_rows(data: dict[str, Any]) -> list[str]:
    """ "target | measured | met" rows for the figures measured so far."""
    rows = []
    best16 = max(
        (r for r in data["decoding"] if r["batch"] == 16 and r.get("ratio") is not None),
        key=lambda r: r["ratio"],
        default=None,
    )
    if best16:
        ok = best16["ratio"] >= 0.5
        rows.append(
            f"AR decoding at batch 16 >= 0.5 x the HBM roofline | {best16['ratio']:.3f} "
            f"({best16['decoding']}, {_f(best16['tokens_per_s'])} tokens/s) | {'yes' if ok else 'no'}"
        )
    for r in data["pipeline"]:
        if (r["height"], r["width"]) != (1024, 1024):
            continue
        per_step = r["dit_seconds"] / r["num_inference_steps"]
        at_30 = r["ar_seconds"] + SGLANG_DIT_STEPS * per_step
        rows.append(
            f"1024² text to image < SGLang's {SGLANG_SECONDS} s (30 DiT steps) | {_f(at_30, 1)} s (AR "
            f"{_f(r['ar_seconds'], 1)} s + 30 x {_f(per_step, 3)} s, {r['decoding']}) | "
            f"{'yes' if at_30 < SGLANG_SECONDS else 'no'}"
        )
        peak_gb = r["peak_memory_gib"] * GIB / 1e9
        ok = r["seconds"] < VENDOR_SECONDS and peak_gb < VENDOR_PEAK_GB
        rows.append(
            f"1024² text to image, {r['num_inference_steps']} steps < the vendor's {VENDOR_SECONDS} s / "
            f"{VENDOR_PEAK_GB} GB | {_f(r['seconds'], 1)} s / {_f(peak_gb, 1)} GB | {'yes' if ok else 'no'}"
        )
    dit = data["training"].get("dit")
    if dit and dit.get("mfu") is not None:
        rows.append(
            f"DiT LoRA step MFU >= 40% | {_f(100 * dit['mfu'])} % | {'yes' if dit['mfu'] >= 0.4 else 'no'}"
        )
    for name, r in data["training"].items():
        if r.get("plan_peak_gib"):
            ratio = r["peak_memory_gib"] / r["plan_peak_gib"]
            rows.append(
                f"{name} step peak within 15% of the plan | {_f(r['peak_memory_gib'], 2)} / "
                f"{_f(r['plan_peak_gib'], 2)} GiB = {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.15 else 'no'}"
            )
    return rows


def render_markdown(data: dict[str, Any]) -> str:
    """The report as markdown tables, ready to paste into docs/benchmarks.md."""
    env, run = data.get("environment", {}), data.get("run", {})
    bw, mm = data.get("bandwidth") or {}, data.get("matmul") or {}
    device = env.get("device_name", "?")
    if env.get("cuda_runtime"):
        device += f" (driver {env.get('driver_version') or '?'}, CUDA {env['cuda_runtime']})"
    versions = " / ".join(env.get("versions", {}).get(p, "?") for p in PACKAGES)
    about = [
        f"device | {device}",
        f"CPU | {env.get('cpu_model', '?')}, {env.get('cpu_count', '?')} cores",
        f"{' / '.join(PACKAGES)} | {versions}",
        f"model | {run.get('model', '?')}",
        f"memory bandwidth (measured) | {_f(bw.get('bytes_per_s', 0) / 1e9)} GB/s (a copy of "
        f"{_f(bw.get('copy_bytes', 0) / GIB, 2)} GiB on the device, read + write)",
        f"{mm.get('dtype', '?')} matmul (measured) | {_f(mm.get('flops_per_s', 0) / 1e12, 2)} TFLOP/s "
        f"({mm.get('n', '?')}³)",
    ]
    checks = [
        f"{c['seed']} | {c['name']} | {'pass' if c['passed'] else 'FAIL'} | {c['message'].replace('|', '/')}"
        for c in data["checks"]
    ]
    steps = []
    for r in data["training"].values():
        phases, plan, flops = r["phases"], r.get("plan_peak_gib"), r.get("update_flops_per_s")
        steps.append(
            f"{r['component']} | {r['recipe']} | {r['height']}x{r['width']} | {r['samples']} | "
            f"{_f(r['step_seconds'], 2)} | {_f(phases['rollout']['seconds'], 2)} | "
            f"{_f(phases['update']['seconds'], 2)} | {_f(r['peak_memory_gib'], 2)} | {_f(plan, 2)} | "
            f"{_f(r['peak_memory_gib'] / plan if plan else None, 2)} | "
            f"{_f(flops / 1e12 if flops else None, 3)} | {_f(100 * r['mfu']) + ' %' if r.get('mfu') else '-'}"
        )
    source = next(iter(data["training"].values()))["peak_memory_source"] if steps else "-"
    decoding = [
        f"{r['height']}x{r['width']} | {r['decoding']} | {r['batch']} | {r['num_steps']} | "
        f"{_f(r['prefill_seconds'], 2)} | {_f(r['step_ms'], 2)} | {_f(r['tokens_per_s'])} | "
        f"{_f(r['roofline_tokens_per_s'])} | {_f(r['ratio'], 3)} | {_f(r.get('compile_seconds'), 1)} | "
        f"{_f(r['peak_memory_gib'], 2)}"
        for r in data["decoding"]
    ]
    pipeline = [
        f"{r['height']}x{r['width']} | {r['decoding']} | {r['ar_tokens']} | {_f(r['ar_seconds'], 2)} | "
        f"{r['num_inference_steps']} | {_f(r['dit_seconds'], 2)} | {_f(r['seconds'], 2)} | "
        f"{_f(r['peak_memory_gib'], 2)} | {r['finite']}"
        for r in data["pipeline"]
    ]
    passed = sum(c["passed"] for c in data["checks"])
    lines = [
        f"### `python -m glm_training.gpu_check` on {env.get('device_name', '?')}",
        "",
        f"{'PASSED' if data.get('passed') else 'FAILED'}: {passed} of {len(data['checks'])} checks passed, "
        f"{len(data['errors'])} stage error(s); {_f(data.get('wall_seconds'))} s in all.",
        "",
        *_table(" | ", about),
        "",
        "#### Targets",
        "",
        *_table("target | measured | met", target_rows(data)),
        "",
        "#### Seed checks",
        "",
        *_table("seed | check | result | message", checks),
        "",
        "#### One LoRA training step (the project's trainer around the in-memory model)",
        "",
        *_table(
            "half | recipe | size | samples: | step (s): | rollout (s): | update (s): | peak (GiB): | "
            "plan peak (GiB): | measured / plan: | update TFLOP/s: | MFU:",
            steps,
        ),
        "",
        "Driven by `<Trainer>.train()` for one step, its `_build_model` handing over the in-memory pipeline "
        "(no checkpoint written); the DiT's prior tokens are seeded random codebook ids, as a prior cache "
        f"hands them over. Peak memory: {source}, over the step; the plan is `glm_training.plan`'s "
        "prediction for the same config. DiT update FLOPs: 4 N T per policy forward (+2 N T per reference "
        "forward), N = the DiT's linear weights, T = latent tokens: a lower bound (no attention scores, no "
        "checkpointing recompute). MFU against the data sheet's dense bf16 peak.",
        "",
        "#### AR decoding: `decode_first_tokens`, image tokens/s over a fixed number of steps",
        "",
        *_table(
            "size | decoding | batch: | steps: | prefill (s): | step (ms): | tokens/s: | "
            "roofline tokens/s: | ratio: | compile (s): | peak (GiB):",
            decoding,
        ),
        "",
        "tokens/s = batch x (steps - 1) / (time of `steps` draws - time of the prefill's one draw). "
        "Roofline: batch x bandwidth / the bytes a decoding step reads (the text model's weights once, the "
        "batch's embedding rows, the KV cache: the loop's whole preallocated cache, generate()'s at the mean "
        "context).",
        "",
        "#### Text to image: the project's decoding loop, then `pipe(prompt=..., prior_token_ids=...)`",
        "",
        *_table(
            "size | decoding | AR tokens: | AR (s): | DiT steps: | DiT + VAE (s): | total (s): | "
            "peak (GiB): | finite",
            pipeline,
        ),
    ]
    if data["errors"]:
        errors = [
            f"{e['stage']} | {e['error'].splitlines()[0][:300].replace('|', '/')}" for e in data["errors"]
        ]
        lines += ["", "#### Stage errors", "", *_table("stage | error", errors)]
    return "\n".join(lines) + "\n"


SECTIONS = ("seeds", "dit", "ar", "decoding", "pipeline")  # in order of value; the environment always runs


def parse_settings(argv: list[str] | None) -> Settings:
    from glm_training.environment import cpu_has_native_bf16
    from glm_training.models import shape
    from glm_training.rollout.ar import DECODING_PATHS

    parser = argparse.ArgumentParser(
        prog="python -m glm_training.gpu_check", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), help="where to run (default: cuda when present, else cpu)")
    add("--toy", action="store_true", help="one layer per stack, 64x64, batches 1 and 2: runs on a CPU")
    add(
        "--output",
        type=Path,
        default=Path("outputs/gpu_check"),
        help="folder for gpu_check.jsonl, gpu_check.json and gpu_check.md (default: outputs/gpu_check)",
    )
    add(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        help=f"what to run, always in this order (default: every one, {' '.join(SECTIONS)})",
    )
    add("--sizes", type=int, nargs="+", help="text-to-image sizes (default 1024; --toy: 64)")
    add("--batch-sizes", type=int, nargs="+", help="AR decoding batch sizes (default 1 16; --toy: 1 2)")
    add(
        "--decoding",
        nargs="+",
        choices=DECODING_PATHS,
        help=f"AR decoding paths to time (default: every one, {' '.join(DECODING_PATHS)})",
    )
    add("--decode-steps", type=int, help="decoding steps timed per path and batch (default 128; --toy: 8)")
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="also time the loop's compiled step, and use it for the text-to-image call (default: on CUDA)",
    )
    add("--num-inference-steps", type=int, help="DiT steps of the text-to-image call (default 50; --toy: 2)")
    add("--train-size", type=int, help="image size of the training steps (default 1024; --toy: 64)")
    for half in ("dit", "ar"):
        add(
            f"--{half}-overrides",
            nargs="+",
            default=[],
            metavar="KEY=VALUE",
            help=f"config overrides of the {half} training step, after the check's own "
            + ("(e.g. sampling.compile=true)" if half == "ar" else "(e.g. sampling.micro_batch_size=1)"),
        )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no CUDA device; on a CPU run --device cpu --toy.")
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = tuple(args.sizes or ((64,) if args.toy else (1024,)))
    train_size = args.train_size or (64 if args.toy else 1024)
    if any(size % 32 for size in (*sizes, train_size)):
        parser.error(f"sizes must be multiples of 32 (GLM-Image's token grid), got {sizes} and {train_size}.")
    decode_steps = args.decode_steps or (8 if args.toy else 128)
    if decode_steps < 2:
        parser.error(
            f"--decode-steps must be at least 2 (one step beyond the prefill's draw), got {decode_steps}."
        )
    if device.type == "cpu" and not args.toy:
        logger.warning("[gpu_check] the real depth on the CPU needs ~40 GB of RAM and hours; add --toy.")
    real = dict(
        ar=shape.REAL_NUM_AR_LAYERS,
        vision=shape.REAL_NUM_VISION_LAYERS,
        dit=shape.REAL_NUM_DIT_LAYERS,
        glyph=shape.REAL_NUM_GLYPH_LAYERS,
    )
    return Settings(
        device=device,
        dtype=torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32,
        toy=args.toy,
        sections=tuple(name for name in SECTIONS if name in (args.sections or SECTIONS)),
        sizes=sizes,
        batch_sizes=tuple(args.batch_sizes or ((1, 2) if args.toy else (1, 16))),
        decoding_paths=tuple(args.decoding or DECODING_PATHS),
        decode_steps=decode_steps,
        compile=device.type == "cuda" if args.compile is None else args.compile,
        num_inference_steps=args.num_inference_steps or (2 if args.toy else 50),
        train_size=train_size,
        overrides={"dit": args.dit_overrides, "ar": args.ar_overrides},
        output=args.output,
        layers={name: 1 for name in real} if args.toy else real,
    )


def main(argv: list[str] | None = None) -> int:
    from glm_training.logs import setup_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; a stray download fails at once
    setup_logging(True)
    s = parse_settings(argv)
    report = Report(s)
    depth = "one layer per stack (toy)" if s.toy else "real depth"
    layers = ", ".join(f"{k} {v}" for k, v in s.layers.items())
    dtype = str(s.dtype).replace("torch.", "")
    report.data["run"] = {
        "toy": s.toy,
        "dtype": dtype,
        "layers": s.layers,
        "sections": s.sections,
        "sizes": s.sizes,
        "batch_sizes": s.batch_sizes,
        "decoding_paths": s.decoding_paths,
        "decode_steps": s.decode_steps,
        "compile": s.compile,
        "num_inference_steps": s.num_inference_steps,
        "train_size": s.train_size,
        "overrides": s.overrides,
        "model": f"GLM-Image widths, {depth} ({layers}), random weights, {dtype}",
    }
    with report.stage("environment, memory bandwidth and matmul throughput", "environment") as out:
        out["environment"] = report.data["environment"] = environment(s.device)
        out["run"] = report.data["run"]
        out["bandwidth"] = report.data["bandwidth"] = measure_bandwidth(s.device)
        out["matmul"] = report.data["matmul"] = measure_matmul(s.device, s.dtype)
    bandwidth = (report.data.get("bandwidth") or {}).get("bytes_per_s")
    matmul = (report.data.get("matmul") or {}).get("flops_per_s")
    spec = spec_peak_flops(report.data["environment"]["device_name"]) if s.device.type == "cuda" else None
    if "seeds" in s.sections:
        with (
            report.stage("seed checks (tiny GLM-Image)", "seeds") as out,
            tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp,
        ):
            from glm_training.models.tiny import save_tiny_pipeline

            out["checks"] = report.data["checks"] = run_checks(s, save_tiny_pipeline(Path(tmp) / "tiny"))
    if set(s.sections) - {"seeds"}:
        try:
            with report.stage(f"build the model on {s.device} ({depth})", "build", fatal=True) as out:
                with measured(s.device) as m:
                    pipe = build_pipeline(s)
                    out["params"] = {
                        n: _numel(getattr(pipe, n))
                        for n in ("vision_language_encoder", "transformer", "text_encoder", "vae")
                    }
                    out["ar_logits"] = ar_logits_check(pipe, s.device)
                out.update(m)
                report.data["build"] = out
                if not out["ar_logits"]["finite"]:
                    raise FloatingPointError("the AR model's logits are not finite after initialisation")
        except Exception:
            return 1
    for component in ("dit", "ar"):
        if component in s.sections:
            name = f"{component} LoRA training step {s.train_size}x{s.train_size}"
            with report.stage(name, component) as out:
                out.update(train_step(component, pipe, s, matmul, spec))
                report.data["training"][component] = out
    if "decoding" in s.sections:
        run_decoding(report, pipe, bandwidth)
    if "pipeline" in s.sections:
        # The compiled step only where it compiled above (or was not tried).
        failed = any("+compile" in e["stage"] for e in report.data["errors"])
        for size in s.sizes:
            name = f"text to image {size}x{size}, {s.num_inference_steps} DiT steps"
            with report.stage(name, "pipeline") as out:
                compile = s.compile and not failed
                out.update(time_text_to_image(pipe, size, s.num_inference_steps, s.device, compile))
                report.data["pipeline"].append(out)
                if not out["finite"]:
                    raise FloatingPointError(f"the {size}x{size} image holds NaN or inf pixels")
    report.write()
    logger.info(
        "[gpu_check] %s; wrote %s, %s and %s",
        "PASSED" if report.passed else "FAILED",
        report.lines,
        s.output / "gpu_check.json",
        s.output / "gpu_check.md",
    )
    return 0 if report.passed else 1


def run_decoding(report: Report, pipe, bandwidth: float | None) -> None:
    """Every decoding path at every batch size, eager; then, with `--compile`, the loop's compiled step
    (the largest batch first: compiling costs a minute or more a shape)."""
    s = report.settings
    size = s.sizes[0]
    with report.stage("AR decoding warm-up (each path, batch 1, 2 steps)", "decoding"):
        from glm_training.rollout.ar import SamplingParams, decode_first_tokens

        for decoding in s.decoding_paths:
            params = SamplingParams.from_pipeline(pipe)
            decode_first_tokens(pipe, [PROMPT], size, size, params, 0, 2, decoding=decoding)
    runs = [(decoding, False, batch) for decoding in s.decoding_paths for batch in s.batch_sizes]
    if s.compile:
        runs += [("loop", True, batch) for batch in sorted(s.batch_sizes, reverse=True)]
    for decoding, compile, batch in runs:
        label = f"{decoding}+compile" if compile else decoding
        with report.stage(f"AR decoding {label} {size}x{size} batch {batch}", "decoding") as out:
            out.update(
                time_decoding(pipe, decoding, compile, size, batch, s.decode_steps, bandwidth, s.device)
            )
            report.data["decoding"].append(out)


if __name__ == "__main__":
    raise SystemExit(main())

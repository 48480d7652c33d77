"""`python -m glm_training.gpu_check`: the run, stage by stage. The environment first, then the sections in
order of value (`SECTIONS`), each a stage of the `Report` (or one stage per size, batch and decoding path);
exit status 1 when a check fails or a stage raises."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from glm_training.gpu_check.build import ar_logits_check, build_pipeline, numel
from glm_training.gpu_check.decoding import time_decoding, time_text_to_image
from glm_training.gpu_check.measure import (
    environment,
    measure_bandwidth,
    measure_matmul,
    measured,
    spec_peak_flops,
)
from glm_training.gpu_check.report import Report
from glm_training.gpu_check.seeds import run_checks
from glm_training.gpu_check.settings import PROMPT, Settings, parse_settings
from glm_training.gpu_check.training import train_step

logger = logging.getLogger("glm_training.gpu_check")


def main(argv: list[str] | None = None) -> int:
    """Run the check with the command line `argv` (None: the process's); 0 when every check and stage
    passed, else 1."""
    from glm_training.logs import setup_logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; a stray download fails at once
    setup_logging(True)
    s = parse_settings(argv)
    report = Report(s)
    report.data["run"] = run_record(s)
    bandwidth, matmul, spec = run_environment(report)
    if "seeds" in s.sections:
        run_seeds(report)
    pipe = None
    if set(s.sections) - {"seeds"}:
        try:
            pipe = run_build(report)
        except Exception:
            return 1
    for component in ("dit", "ar"):
        if component in s.sections:
            name = f"{component} LoRA training step {s.train_size}x{s.train_size}"
            with report.stage(name, component) as out:
                out.update(train_step(component, pipe, s, matmul, spec))
                report.data["training"][component] = out
    if "recipes" in s.sections:
        run_recipes(report, pipe, matmul, spec)
    if "decoding" in s.sections:
        run_decoding(report, pipe, bandwidth)
    if "pipeline" in s.sections:
        run_text_to_image(report, pipe)
    report.write()
    logger.info(
        "[gpu_check] %s; wrote %s, %s and %s",
        "PASSED" if report.passed else "FAILED",
        report.lines,
        s.output / "gpu_check.json",
        s.output / "gpu_check.md",
    )
    return 0 if report.passed else 1


def _depth(s: Settings) -> str:
    return "one layer per stack (toy)" if s.toy else "real depth"


def run_record(s: Settings) -> dict[str, Any]:
    """The report's `run`: the settings as measured, and the model they describe."""
    layers = ", ".join(f"{k} {v}" for k, v in s.layers.items())
    dtype = str(s.dtype).replace("torch.", "")
    return {
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
        "profile": s.profile,
        "packed_attention": s.packed_attention,
        "recipes": s.recipes,
        "model": f"GLM-Image widths, {_depth(s)} ({layers}), random weights, {dtype}",
    }


def run_environment(report: Report) -> tuple[float | None, float | None, float | None]:
    """The environment stage; (measured copy bandwidth bytes/s, measured matmul FLOP/s, the data sheet's
    bf16 peak on CUDA), None where unknown."""
    s = report.settings
    with report.stage("environment, memory bandwidth and matmul throughput", "environment") as out:
        out["environment"] = report.data["environment"] = environment(s.device)
        out["run"] = report.data["run"]
        out["bandwidth"] = report.data["bandwidth"] = measure_bandwidth(s.device)
        out["matmul"] = report.data["matmul"] = measure_matmul(s.device, s.dtype)
    bandwidth = (report.data.get("bandwidth") or {}).get("bytes_per_s")
    matmul = (report.data.get("matmul") or {}).get("flops_per_s")
    spec = spec_peak_flops(report.data["environment"]["device_name"]) if s.device.type == "cuda" else None
    return bandwidth, matmul, spec


def run_seeds(report: Report) -> None:
    """The seed checks' stage, on a tiny GLM-Image saved in a temporary folder."""
    with (
        report.stage("seed checks (tiny GLM-Image)", "seeds") as out,
        tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp,
    ):
        from glm_training.models.tiny import save_tiny_pipeline

        out["checks"] = report.data["checks"] = run_checks(
            report.settings, save_tiny_pipeline(Path(tmp) / "tiny")
        )


def run_build(report: Report):
    """The build stage, fatal: the pipeline at the settings' depth on the device, its AR logits finite."""
    s = report.settings
    with report.stage(f"build the model on {s.device} ({_depth(s)})", "build", fatal=True) as out:
        with measured(s.device) as m:
            pipe = build_pipeline(s)
            out["params"] = {
                n: numel(getattr(pipe, n))
                for n in ("vision_language_encoder", "transformer", "text_encoder", "vae")
            }
            out["ar_logits"] = ar_logits_check(pipe, s.device)
        out.update(m)
        report.data["build"] = out
        if not out["ar_logits"]["finite"]:
            raise FloatingPointError("the AR model's logits are not finite after initialisation")
    return pipe


def run_recipes(report: Report, pipe, matmul: float | None, spec: float | None) -> None:
    """One stage per recipe (`gpu_check.recipes`): a training step and its images per GPU-second."""
    from glm_training.gpu_check.recipes import recipe_row

    s = report.settings
    for name in s.recipes:
        with report.stage(f"recipe {name} {s.train_size}x{s.train_size}", "recipes") as out:
            out.update(recipe_row(name, pipe, s, matmul, spec))
            report.data["recipes"].append(out)


def run_decoding(report: Report, pipe, bandwidth: float | None) -> None:
    """Every decoding path at every batch size, eager; then, with `--compile`, the loop's compiled step
    (the largest batch first: compiling costs a minute or more a shape)."""
    s = report.settings
    size = s.sizes[0]
    with report.stage("AR decoding warm-up (each path, batch 1, 2 steps)", "decoding"):
        from glm_training.pipeline.ar import decode_first_tokens
        from glm_training.pipeline.ar_logits import SamplingParams

        for decoding in s.decoding_paths:
            params = SamplingParams.from_pipeline(pipe)
            decode_first_tokens(pipe, [PROMPT], size, size, params, 0, 2, decoding=decoding)
    runs = [(decoding, False, batch) for decoding in s.decoding_paths for batch in s.batch_sizes]
    if s.compile:
        runs += [("loop", True, batch) for batch in sorted(s.batch_sizes, reverse=True)]
    # --profile decoding: the compiled loop at the largest batch (the first compiled run), else the last run.
    profiled_run = runs[len(s.decoding_paths) * len(s.batch_sizes)] if s.compile else runs[-1]
    for run in runs:
        decoding, compile, batch = run
        label = f"{decoding}+compile" if compile else decoding
        wanted = "decoding" in s.profile and run == profiled_run
        profile = s.output / "profile_decoding.txt" if wanted else None
        with report.stage(f"AR decoding {label} {size}x{size} batch {batch}", "decoding") as out:
            out.update(
                time_decoding(
                    pipe,
                    decoding,
                    compile,
                    size,
                    batch,
                    s.decode_steps,
                    bandwidth,
                    s.device,
                    profile,
                    s.packed_attention and decoding == "loop",
                )
            )
            report.data["decoding"].append(out)


def run_text_to_image(report: Report, pipe) -> None:
    """One text-to-image call at each size, each a stage; its pixels must be finite."""
    s = report.settings
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

"""The report as markdown, ready to paste into docs/benchmarks.md: the environment, the targets met so far,
the seed checks, the training steps, AR decoding and the text-to-image calls, then any stage errors."""

from __future__ import annotations

import math
from typing import Any

from glm_training.gpu_check.measure import GIB, PACKAGES


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
    env = data.get("environment", {})
    passed = sum(c["passed"] for c in data["checks"])
    lines = [
        f"### `python -m glm_training.gpu_check` on {env.get('device_name', '?')}",
        "",
        f"{'PASSED' if data.get('passed') else 'FAILED'}: {passed} of {len(data['checks'])} checks passed, "
        f"{len(data['errors'])} stage error(s); {_f(data.get('wall_seconds'))} s in all.",
        "",
        *_table(" | ", _about_rows(data)),
        "",
        "#### Targets",
        "",
        *_table("target | measured | met", target_rows(data)),
        "",
        "#### Seed checks",
        "",
        *_table("seed | check | result | message", _check_rows(data)),
        "",
        *_training_lines(data),
        "",
        *(_recipe_lines(data["recipes"]) + [""] if data.get("recipes") else []),
        *_decoding_lines(data),
        "",
        *_pipeline_lines(data),
    ]
    if data["errors"]:
        errors = [
            f"{e['stage']} | {e['error'].splitlines()[0][:300].replace('|', '/')}" for e in data["errors"]
        ]
        lines += ["", "#### Stage errors", "", *_table("stage | error", errors)]
    return "\n".join(lines) + "\n"


def _about_rows(data: dict[str, Any]) -> list[str]:
    """The environment table's rows: device, CPU, versions, model, measured bandwidth and matmul."""
    env, run = data.get("environment", {}), data.get("run", {})
    bw, mm = data.get("bandwidth") or {}, data.get("matmul") or {}
    device = env.get("device_name", "?")
    if env.get("cuda_runtime"):
        device += f" (driver {env.get('driver_version') or '?'}, CUDA {env['cuda_runtime']})"
    versions = " / ".join(env.get("versions", {}).get(p, "?") for p in PACKAGES)
    return [
        f"device | {device}",
        f"CPU | {env.get('cpu_model', '?')}, {env.get('cpu_count', '?')} cores",
        f"{' / '.join(PACKAGES)} | {versions}",
        f"model | {run.get('model', '?')}",
        f"memory bandwidth (measured) | {_f(bw.get('bytes_per_s', 0) / 1e9)} GB/s (a copy of "
        f"{_f(bw.get('copy_bytes', 0) / GIB, 2)} GiB on the device, read + write)",
        f"{mm.get('dtype', '?')} matmul (measured) | {_f(mm.get('flops_per_s', 0) / 1e12, 2)} TFLOP/s "
        f"({mm.get('n', '?')}³)",
    ]


def _check_rows(data: dict[str, Any]) -> list[str]:
    return [
        f"{c['seed']} | {c['name']} | {'pass' if c['passed'] else 'FAIL'} | {c['message'].replace('|', '/')}"
        for c in data["checks"]
    ]


def _training_lines(data: dict[str, Any]) -> list[str]:
    """The training steps' section: heading, table and how the figures were taken."""
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
    return [
        "#### One LoRA training step (the project's trainer around the in-memory model)",
        "",
        *_table(
            "half | recipe | size | samples: | step (s): | rollout (s): | update (s): | peak (GiB): | "
            "plan peak (GiB): | measured / plan: | update TFLOP/s: | MFU:",
            steps,
        ),
        "",
        "Driven by `Trainer(cfg, pipeline=...).train()` for one step, handed the in-memory pipeline "
        "(no checkpoint written); the DiT's prior tokens are seeded random codebook ids, as a prior cache "
        f"hands them over. Peak memory: {source}, over the step; the plan is `glm_training.plan`'s "
        "prediction for the same config. DiT update FLOPs (`training.dit_update_flops`): linear layers "
        "(2 N T a forward, N = the DiT's linear weights, T = latent tokens) and attention (4 T² d L), a "
        "policy forward with its backward, a reference forward without; the recompute of gradient "
        "checkpointing apart (in the HFU, not the MFU). MFU against the data sheet's dense bf16 peak.",
    ]


def _decoding_lines(data: dict[str, Any]) -> list[str]:
    """The AR decoding section: heading, table and how tokens/s and the roofline are taken."""
    decoding = [
        f"{r['height']}x{r['width']} | {r['decoding']} | {r['batch']} | {r['num_steps']} | "
        f"{_f(r['prefill_seconds'], 2)} | {_f(r['step_ms'], 2)} | {_f(r['tokens_per_s'])} | "
        f"{_f(r['roofline_tokens_per_s'])} | {_f(r['ratio'], 3)} | {_f(r.get('compile_seconds'), 1)} | "
        f"{_f(r['peak_memory_gib'], 2)}"
        for r in data["decoding"]
    ]
    return [
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
    ]


def _pipeline_lines(data: dict[str, Any]) -> list[str]:
    """The text-to-image section: heading and table."""
    pipeline = [
        f"{r['height']}x{r['width']} | {r['decoding']} | {r['ar_tokens']} | {_f(r['ar_seconds'], 2)} | "
        f"{r['num_inference_steps']} | {_f(r['dit_seconds'], 2)} | {_f(r['seconds'], 2)} | "
        f"{_f(r['peak_memory_gib'], 2)} | {r['finite']}"
        for r in data["pipeline"]
    ]
    return [
        "#### Text to image: the project's decoding loop, then `pipe(prompt=..., prior_token_ids=...)`",
        "",
        *_table(
            "size | decoding | AR tokens: | AR (s): | DiT steps: | DiT + VAE (s): | total (s): | "
            "peak (GiB): | finite",
            pipeline,
        ),
    ]


def _recipe_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown section of the `recipes` rows."""
    lines = [
        f"{r['spec']} | {r['component']} | {r['samples']} | {r['num_steps']} | "
        f"{_f(r['phases']['rollout']['seconds'], 2)} | {_f(r['phases']['update']['seconds'], 2)} | "
        f"{_f(r['images_per_s'], 3)} | {_f(r['peak_memory_gib'], 2)} | {_f(r.get('ratio_mean'), 6)}"
        for r in rows
    ]
    return [
        "#### Images per GPU-second, one step of each recipe",
        "",
        *_table(
            "recipe | half | samples: | steps: | rollout (s): | update (s): | images / GPU-s: | peak (GiB): "
            "| ratio mean:",
            lines,
        ),
        "",
        "One group of the recipe's micro-batch (DiT) or 4 samples over two steps, the second timed (AR); "
        "images / GPU-s = samples / (rollout + update) of the timed step. Ratio mean: over the timed step's "
        "mini-batches (1 on the first, on-policy one).",
    ]

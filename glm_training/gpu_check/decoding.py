"""Speed of the AR half and of the whole call: AR decoding tokens/s over a fixed number of steps
(`pipeline.ar.decode_first_tokens`) next to its memory-bandwidth roofline, and one text-to-image call (the
project's decoding loop writes the prior tokens, the pipeline's DiT and VAE turn them into pixels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.gpu_check.build import numel
from glm_training.gpu_check.measure import compiled_graphs, measured, profiled
from glm_training.gpu_check.settings import PROMPT


def time_text_to_image(
    pipe, size: int, num_steps: int, device: torch.device, compile: bool
) -> dict[str, Any]:
    """One text-to-image call: the project's decoding loop writes the prior tokens (`sample_image_tokens`,
    compiled when `compile`), then `pipe(prompt=..., prior_token_ids=...)` runs the DiT and the VAE.

    Seconds of each half and in all, peak memory, finite pixels. Where the compiled step had to compile or
    capture its graph during the timed call (`graphs_compiled`), the AR half is timed once more, warm.
    """
    from glm_training.pipeline.ar import sample_image_tokens
    from glm_training.pipeline.ar_logits import SamplingParams

    params = SamplingParams.from_pipeline(pipe)

    def ar_half() -> tuple[Any, dict[str, Any], int]:
        graphs = compiled_graphs()
        with measured(device) as ar:
            samples = sample_image_tokens(pipe, [PROMPT], size, size, params, seed=0, compile=compile)
        return samples, ar, compiled_graphs() - graphs

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
    weights = (numel(decoder) - numel(embed) + numel(model.lm_head) + batch * embed.embedding_dim) * elem
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = batch * context * text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * elem
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def _time_first_tokens(
    pipe,
    prompts: list[str],
    decoding: str,
    compile: bool,
    size: int,
    num_steps: int,
    device: torch.device,
    profile: Path | None = None,
    packed_attention: bool = False,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], int]:
    """The timed calls of `time_decoding`: (compile figures, the prefill's one draw, `num_steps` draws,
    dynamo's graph count before the two timed calls); then, with `profile`, one more call under the
    profiler, its table written there."""
    from glm_training.pipeline.ar import decode_first_tokens
    from glm_training.pipeline.ar_logits import SamplingParams

    params = SamplingParams.from_pipeline(pipe)
    out: dict[str, Any] = {}

    def run(steps: int) -> None:
        decode_first_tokens(
            pipe,
            prompts,
            size,
            size,
            params,
            0,
            steps,
            decoding=decoding,
            compile=compile,
            packed_attention=packed_attention,
        )

    if compile:
        with measured(device) as first:
            run(4)  # compiles, then warms up and captures the CUDA graph
        out["compile_seconds"] = first["seconds"]
    graphs = compiled_graphs()
    with measured(device) as prefill:
        run(1)
    with measured(device) as m:
        run(num_steps)
    with profiled(device, profile):
        if profile is not None:
            run(num_steps)
    return out, prefill, m, graphs


def time_decoding(
    pipe,
    decoding: str,
    compile: bool,
    size: int,
    batch: int,
    num_steps: int,
    bandwidth: float | None,
    device: torch.device,
    profile: Path | None = None,
    packed_attention: bool = False,
) -> dict[str, Any]:
    """Decoding speed over the first `num_steps` steps of a `size`² rollout of `batch` prompts, next to its
    memory-bandwidth roofline (`decode_first_tokens`).

    Two timed calls, one draw (the prefill's) and `num_steps` draws; their difference is `num_steps - 1`
    decoding steps without the prefill: tokens/s = batch x (num_steps - 1) / that difference. With `compile`
    a first call compiles the step and captures its graph (`compile_seconds`). Roofline: `batch` tokens a
    step, a step reading `decode_bytes_per_step` at the measured copy bandwidth; the loop reads its whole
    preallocated cache, generate() its cache at the mean context length.
    """
    from glm_training.pipeline.ar import chat_inputs

    prompts = [PROMPT] * batch
    out, prefill, m, graphs = _time_first_tokens(
        pipe, prompts, decoding, compile, size, num_steps, device, profile, packed_attention
    )
    inputs = chat_inputs(pipe, prompts, size, size)
    num_prompt = inputs["input_ids"].shape[1]
    num_grid = sum(int(t * h * w) for t, h, w in inputs["image_grid_thw"].tolist()) // batch
    context = num_prompt + num_grid + 1 if decoding == "loop" else num_prompt + (num_steps - 1) / 2
    read = decode_bytes_per_step(pipe.vision_language_encoder, batch, context)
    seconds = m["seconds"] - prefill["seconds"]
    speed = batch * (num_steps - 1) / seconds if seconds > 0 else float("nan")
    roofline = batch * bandwidth / read["total"] if bandwidth else None
    label = f"{decoding}+compile" if compile else decoding
    return {
        "decoding": label + ("+packed" if packed_attention and decoding == "loop" else ""),
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
        "graphs_compiled": compiled_graphs() - graphs,
        "peak_memory_gib": max(prefill["peak_memory_gib"], m["peak_memory_gib"]),
        **out,
    }

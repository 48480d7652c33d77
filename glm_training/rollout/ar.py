"""GRPO/DAPO rollout for the GLM-Image AR model: sample image tokens, record their log-probs, recompute them.

GLM-Image's AR model (`GlmImageForConditionalGeneration`, the pipeline's `vision_language_encoder`) writes,
for a text prompt, a small preview grid of image tokens and then the large grid (H/32 x W/32) that the DiT
decodes; `generate()` runs for (preview + large) + 1 steps and the last token is thrown away. For GRPO
(DeepSeekMath, arXiv 2402.03300) and DAPO (arXiv 2503.14476) the policy is the distribution those tokens are
*sampled* from, so this module provides the three pieces a token-level policy-gradient loss needs:

* `process_logits`: logits -> log-probs of the sampling distribution (codebook mask, temperature, top-k,
  top-p, with the order and tie rules of transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper`,
  `TopPLogitsWarper`).
* `sample_image_tokens`: the pipeline's own `generate()` call, with that processing as its only logits
  processor, recording per-token log-probs and the M-RoPE positions the model used.
* `teacher_forced_log_probs`: the same log-probs recomputed with gradients in one forward pass over the whole
  sequence.

Sampling applies `process_logits` itself (transformers' own warpers are switched off), so the distribution
tokens are drawn from is by construction the one recomputed under teacher forcing; the warpers' semantics are
kept (see tests) so that `SamplingParams.from_pipeline` reproduces what `GlmImagePipeline` samples.

Positions. GLM-Image uses 3-row M-RoPE positions (temporal, height, width). At prefill the model computes
them for the prompt and caches per-sample positions for the tokens it will generate (each target grid laid
out in 2D); a forward over prompt + generated tokens *without* `position_ids` would treat the generated tokens
as text and give different logits. `sample_image_tokens` therefore records the `position_ids` that
`generate()` passes to the text model at every step (a forward pre-hook on `model.get_decoder()`), and the
teacher-forced forward passes them back explicitly. Model internals relied on, guarded by
tests/test_ar_logprobs.py: `get_decoder()` is the text model; it receives `position_ids` of shape (3, B, S) as
a keyword argument at every step of `generate()`; an explicit `position_ids` makes the model skip its own
position computation. No private attribute is read.

Two decoding paths (`DECODING_PATHS`) draw the same tokens. The default, `_decode_loop`, is the project's
own loop: image-token positions depend only on the target grids, so they are computed before the first step
(`image_token_positions`); the KV cache is allocated once for the whole sequence; each step keeps only the
drawn token's log-prob (generate()'s `output_scores` keeps a [B, vocabulary] float32 tensor per step: 85 MB
a sample at 1024x1024); and its fixed-shape step can be compiled into one graph (`compile`: CUDA graphs on
CUDA). "generate" is transformers' generate() with the position-recording hook, optionally with its static
KV cache (`generation_speed_kwargs`). tests/test_ar_logprobs.py holds the two to the same tokens, positions
and (up to float rounding) log-probs.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers import LogitsProcessor, LogitsProcessorList, StaticCache
from transformers.cache_utils import StaticLayer

# sample_image_tokens' decoding paths: the project's own loop (default) and transformers' generate().
DECODING_PATHS = ("loop", "generate")

# transformers' defaults for the sampling knobs that neither the pipeline nor a generation_config may set:
# GlmImagePipeline passes only do_sample=True, so an unset top_k means top-k 50.
HF_DEFAULT_TEMPERATURE = 1.0
HF_DEFAULT_TOP_P = 1.0
HF_DEFAULT_TOP_K = 50

# Passed to generate() so that transformers adds no logits processor of its own: the only change to the
# logits is `_SamplingLogitsProcessor`. Each value is the one that makes transformers skip the processor.
_NEUTRAL_GENERATION_KWARGS: dict[str, Any] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "remove_invalid_values": False,
    "renormalize_logits": False,
    "num_beams": 1,
    "num_return_sequences": 1,
}
# generation_config fields that cannot be neutralised per call: their neutral value is None (a None passed to
# generate() is replaced by the model's own value), or overriding them makes transformers warn.
_MUST_BE_NEUTRAL: dict[str, tuple] = {
    "min_p": (None,),
    "top_h": (None,),
    "bad_words_ids": (None,),
    "sequence_bias": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "watermarking_config": (None,),
    "guidance_scale": (None, 1.0),
    "min_new_tokens": (None, 0),
}


@dataclass
class SamplingParams:
    """How image tokens are sampled; the same values must be used when log-probs are recomputed.

    `top_k = 0` and `top_p = 1.0` switch those filters off. `codebook_size`: ids >= this are never sampled
    (the real AR head has 16512 outputs but only ids below 16384 are VQ codebook entries that the DiT can
    embed); None leaves every logit of the head.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    codebook_size: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a positive number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to switch top-p off.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}; use 0 to switch top-k off.")
        if self.codebook_size is not None and self.codebook_size < 1:
            raise ValueError(f"codebook_size must be positive or None, got {self.codebook_size}.")

    @classmethod
    def from_pipeline(cls, pipeline) -> SamplingParams:
        """The distribution `GlmImagePipeline` itself samples from, with the codebook mask added.

        The pipeline calls `generate(do_sample=True)` with nothing else, so temperature, top-p and top-k
        come from the AR model's generation_config and, where it leaves them unset, transformers' defaults
        (top-k 50 included). The codebook size is the DiT's prior vocabulary.
        """
        config = pipeline.vision_language_encoder.generation_config

        def resolved(name: str, default):
            value = getattr(config, name, None)
            return default if value is None else value

        return cls(
            temperature=float(resolved("temperature", HF_DEFAULT_TEMPERATURE)),
            top_p=float(resolved("top_p", HF_DEFAULT_TOP_P)),
            top_k=int(resolved("top_k", HF_DEFAULT_TOP_K)),
            codebook_size=int(pipeline.transformer.config.prior_vq_quantizer_codebook_size),
        )


def resolve_sampling_params(
    pipeline, temperature: float | None, top_p: float | None, top_k: int | None
) -> tuple[SamplingParams, str]:
    """The trained policy's sampling distribution: the pipeline's own, with the values given overriding it.

    None = the value `GlmImagePipeline` samples with (`SamplingParams.from_pipeline`). Returns the params and
    a one-line description for the log, saying where each value came from.
    """
    own = SamplingParams.from_pipeline(pipeline)
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    values = {name: getattr(own, name) if value is None else value for name, value in given.items()}
    params = SamplingParams(**values, codebook_size=own.codebook_size)
    set_names = [name for name, value in given.items() if value is not None]
    if not set_names:
        source = "from the pipeline's generation config"
    elif len(set_names) == len(given):
        source = "set"
    else:
        rest = [name for name in given if name not in set_names]
        source = f"{', '.join(set_names)} set; {', '.join(rest)} from the pipeline's generation config"
    shown = " ".join(f"{name}={values[name]}" for name in given)
    return params, f"AR sampling: {shown} ({source})"


@functools.lru_cache(maxsize=8)
def _outside_codebook(vocab_size: int, codebook_size: int, device: torch.device) -> Tensor:
    """[V] bool: the ids a sample may not take (built once, not at every decoding step)."""
    return torch.arange(vocab_size, device=device) >= codebook_size


def _filtered_logits(logits: Tensor, params: SamplingParams, keep_ids: Tensor | None = None) -> Tensor:
    """float32 logits [..., V] after codebook mask, temperature, top-k, top-p (filtered entries -inf).

    The same operations, in the same order, as transformers' warpers, so that on the same input the result is
    bitwise identical to theirs. The filter masks are computed without gradients; gradients flow through the
    kept entries only.
    """
    logits = logits.float()
    vocab_size = logits.shape[-1]
    if params.codebook_size is not None and params.codebook_size < vocab_size:
        outside = _outside_codebook(vocab_size, params.codebook_size, logits.device)
        logits = logits.masked_fill(outside, -math.inf)
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k == 0 and params.top_p >= 1.0:
        return logits

    keep = None
    if keep_ids is not None:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, keep_ids.unsqueeze(-1), True)
    if params.top_k > 0:
        with torch.no_grad():
            kth_largest = torch.topk(logits, min(params.top_k, vocab_size), dim=-1).values[..., -1:]
            remove = logits < kth_largest  # ties with the k-th value are all kept
            if keep is not None:
                remove &= ~keep
        logits = logits.masked_fill(remove, -math.inf)
    if params.top_p < 1.0:
        with torch.no_grad():
            sorted_logits, sorted_indices = torch.sort(logits, dim=-1, descending=False)
            cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            sorted_remove = cumulative_probs <= (1 - params.top_p)
            sorted_remove[..., -1:] = False  # the most likely token always stays
            remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
            if keep is not None:
                remove &= ~keep
        logits = logits.masked_fill(remove, -math.inf)
    return logits


def process_logits(logits_btv: Tensor, params: SamplingParams, keep_ids_bt: Tensor | None = None) -> Tensor:
    """Log-probs [B, T, V] (float32) of the distribution tokens are sampled from.

    Applies, in transformers' order: the codebook mask (ids >= `codebook_size` get -inf), division by the
    temperature, top-k (ties with the k-th largest value are kept), top-p (the smallest set of most likely
    tokens whose probability exceeds `top_p`, with transformers' tie-breaking by sort order), then
    `log_softmax`. Filtered tokens have log-prob -inf.

    `keep_ids_bt` [B, T]: ids exempt from top-k and top-p (never from the codebook mask). Pass the recorded
    tokens when recomputing log-probs: after the policy moves, a token sampled earlier can fall outside the
    top-k / top-p set of the new logits and would get log-prob -inf (an infinite ratio); exempting it keeps it
    finite. Where the token survives the filters anyway, as at sampling time, the result is unchanged.
    """
    return torch.log_softmax(_filtered_logits(logits_btv, params, keep_ids_bt), dim=-1)


class _SamplingLogitsProcessor(LogitsProcessor):
    """The whole sampling transform of `SamplingParams`, as the one logits processor of `generate()`."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # Filtered logits rather than log-probs: generate() samples from softmax(scores), which then matches
        # transformers' own warpers bit for bit.
        return _filtered_logits(scores, self.params)


@dataclass
class ARSamples:
    """B sequences; everything on CPU."""

    input_ids: Tensor  # [B, L] prompt + generated (left-padded prompts)
    attention_mask: Tensor  # [B, L]
    position_ids: Tensor  # [3, B, L] M-RoPE positions generate() used
    # [B, L] bool: True exactly on generated image tokens (preview + large grid; not the trailing extra token,
    # not prompt or padding)
    completion_mask: Tensor
    # [B, L] float32 log-prob of each generated token under the sampling distribution, recorded during
    # generate() (0 elsewhere)
    sampling_log_probs: Tensor
    prior_token_ids: Tensor  # [B, 4 * (H/32) * (W/32)] upsampled large-grid tokens for the DiT
    image_grid_thw: Tensor  # [B * num_grids, 3] per-sample grids (large, preview), packed along dim 0
    extra: dict[str, Tensor] = field(default_factory=dict)  # other forward inputs (e.g. images_per_sample)


def _module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def generation_speed_kwargs(static_cache: bool) -> dict[str, Any]:
    """generate() arguments for a static KV cache (transformers' `cache_implementation="static"`).

    It changes neither the logits processor, the sampling nor the RNG stream, only the cache's memory layout.
    transformers' automatic compilation (on by default with a static cache on CUDA) is switched off: the
    compiled decoding step is the loop's (`sample_image_tokens(decoding="loop", compile=True)`).
    """
    if not static_cache:
        return {}
    return {"cache_implementation": "static", "disable_compile": True}


def _check_generation_config(model) -> None:
    """Refuse generation_config settings that would reshape the logits behind `process_logits`' back."""
    config = model.generation_config
    for name, neutral in _MUST_BE_NEUTRAL.items():
        value = getattr(config, name, None)
        if value not in neutral:
            raise ValueError(
                f"The AR model's generation_config sets {name}={value!r}, which would change the sampling "
                "distribution without being reproduced when log-probs are recomputed. Set "
                f"`pipeline.vision_language_encoder.generation_config.{name} = None` before sampling."
            )


def _upsample_grid_2x(tokens_bn: Tensor, grid_h: int, grid_w: int) -> Tensor:
    """[B, h*w] row-major grid -> [B, 4*h*w]: each token repeated into a 2x2 block (nearest upsampling)."""
    grid = tokens_bn.view(-1, grid_h, grid_w)
    return grid.repeat_interleave(2, dim=1).repeat_interleave(2, dim=2).reshape(tokens_bn.shape[0], -1)


def chat_inputs(pipeline, prompts: list[str], height: int, width: int):
    """The AR model's text-to-image inputs for `prompts`, built as `GlmImagePipeline.generate_prior_tokens`
    builds them (chat template with the target size; left padding for a batch). On CPU."""
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}] for prompt in prompts]
    return pipeline.processor.apply_chat_template(
        messages,
        tokenize=True,
        padding=len(prompts) > 1,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )


def _check_decoding(decoding: str, static_cache: bool, compile: bool) -> None:
    if decoding not in DECODING_PATHS:
        raise ValueError(f"decoding must be one of {DECODING_PATHS}, got {decoding!r}.")
    if decoding == "loop" and static_cache:
        raise ValueError(
            "static_cache applies to decoding='generate' (transformers' cache_implementation='static'); the "
            "decoding loop always preallocates its KV cache. Drop static_cache."
        )
    if decoding == "generate" and compile:
        raise ValueError(
            "compile applies to decoding='loop' (the loop's fixed-shape step compiles into one graph); "
            "use decoding='loop', or drop compile."
        )


@torch.no_grad()
def sample_image_tokens(
    pipeline,
    prompts: list[str],
    height: int,
    width: int,
    params: SamplingParams,
    seed: int,
    decoding: str = "loop",
    static_cache: bool = False,
    compile: bool = False,
) -> ARSamples:
    """Sample one token sequence per prompt (text-to-image) with the pipeline's AR model.

    The caller repeats each prompt `num_generations` times. Prompts are tokenized exactly as
    `GlmImagePipeline.generate_prior_tokens` does (left-padded batch). Sampling is seeded like the pipeline
    (`torch.manual_seed(seed)`, which also seeds the model's accelerator), inside `torch.random.fork_rng`
    so that the caller's RNG state is left as it was: with `SamplingParams.from_pipeline(pipeline)` the
    tokens equal the pipeline's for the same seed. Returns everything on CPU.

    `decoding` (`DECODING_PATHS`), two ways to the same tokens:

    * "loop" (default): the project's own decoding loop (`_decode_loop`): positions computed up front, a
      preallocated KV cache, each sampled token's log-prob computed in its step; `compile` runs the decoding
      step through torch.compile (CUDA graphs on CUDA).
    * "generate": transformers' `generate()` with `output_scores` and a hook recording the positions;
      `static_cache` preallocates its KV cache (`generation_speed_kwargs`).

    Both draw the same tokens for a seed (one `torch.multinomial` per step on the same probabilities; bit for
    bit on CPU in float32) and record the same log-probs up to float rounding (tests/test_ar_logprobs.py).
    """
    _check_decoding(decoding, static_cache, compile)
    inputs, grid_sizes = _rollout_inputs(pipeline, prompts, height, width)
    prompt_mask = inputs["attention_mask"]
    batch_size, num_prompt_tokens = prompt_mask.shape
    large_h, large_w = height // 32, width // 32
    num_grid_tokens = sum(grid_sizes)
    large_offset = num_grid_tokens - grid_sizes[0]
    max_new_tokens = num_grid_tokens + 1
    total_length = num_prompt_tokens + max_new_tokens
    sequences, position_ids, step_log_probs = _decode(
        pipeline.vision_language_encoder,
        inputs,
        max_new_tokens,
        num_grid_tokens,
        params,
        seed,
        decoding,
        static_cache,
        compile,
    )
    if position_ids.shape != (3, batch_size, total_length):
        raise RuntimeError(
            f"Positions of shape {tuple(position_ids.shape)}, expected {(3, batch_size, total_length)}; "
            "glm_training.rollout.ar needs updating for this transformers version."
        )

    generated = sequences[:, num_prompt_tokens:]
    prior_vocab = int(pipeline.transformer.config.prior_vq_quantizer_codebook_size)
    if int(generated[:, :num_grid_tokens].max()) >= prior_vocab:
        raise RuntimeError(
            f"Sampled a token id >= {prior_vocab}, outside the DiT's prior vocabulary. Set "
            f"SamplingParams.codebook_size={prior_vocab}."
        )

    completion_mask = torch.zeros(batch_size, total_length, dtype=torch.bool)
    completion_mask[:, num_prompt_tokens : num_prompt_tokens + num_grid_tokens] = True
    sampling_log_probs = torch.zeros(batch_size, total_length, dtype=torch.float32)
    sampling_log_probs[:, num_prompt_tokens : num_prompt_tokens + num_grid_tokens] = step_log_probs

    large_grid = generated[:, large_offset : large_offset + large_h * large_w]
    own_fields = ("input_ids", "attention_mask", "image_grid_thw")
    extra = {key: value for key, value in inputs.items() if key not in own_fields}
    return ARSamples(
        input_ids=sequences,
        attention_mask=torch.cat(
            [prompt_mask, torch.ones(batch_size, max_new_tokens, dtype=prompt_mask.dtype)], dim=1
        ),
        position_ids=position_ids,
        completion_mask=completion_mask,
        sampling_log_probs=sampling_log_probs,
        prior_token_ids=_upsample_grid_2x(large_grid, large_h, large_w),
        image_grid_thw=inputs["image_grid_thw"],
        extra=extra,
    )


def _rollout_inputs(
    pipeline, prompts: list[str], height: int, width: int
) -> tuple[dict[str, Tensor], list[int]]:
    """A text-to-image rollout's AR inputs (CPU) and its target grids' token counts, large grid first.

    Decoding writes the grids in reverse order (preview first), then one extra token.
    """
    if height % 32 or width % 32:
        raise ValueError(f"height and width must be multiples of 32, got {height}x{width}.")
    if not prompts:
        raise ValueError("prompts is empty.")
    _check_generation_config(pipeline.vision_language_encoder)
    inputs = chat_inputs(pipeline, prompts, height, width)
    if not bool(inputs["attention_mask"][:, -1].all()):
        raise ValueError(
            "The AR tokenizer pads on the right; generated tokens would not start at a common position. "
            "Set `pipeline.processor.tokenizer.padding_side = 'left'`."
        )
    image_grid_thw = inputs["image_grid_thw"]
    num_grids = image_grid_thw.shape[0] // len(prompts)
    grids = image_grid_thw[:num_grids].tolist()
    if tuple(grids[0][1:]) != (height // 32, width // 32):
        raise RuntimeError(f"Unexpected target grids {grids} for {height}x{width}.")
    return inputs, [int(h * w) for _, h, w in grids]


def _decode(
    model,
    inputs: dict[str, Tensor],
    max_new_tokens: int,
    num_grid_tokens: int,
    params: SamplingParams,
    seed: int,
    decoding: str,
    static_cache: bool,
    compile: bool,
    stop_after: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded decoding on the model's device by `decoding`'s path: (sequences, positions, log-probs), CPU."""
    device = _module_device(model)
    device_inputs = {key: value.to(device) for key, value in inputs.items()}
    fork_devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=fork_devices, device_type=device.type if fork_devices else "cuda"):
        torch.manual_seed(seed)
        if decoding == "loop":
            return _decode_loop(
                model, device_inputs, max_new_tokens, num_grid_tokens, params, compile, stop_after
            )
        return _decode_with_generate(
            model, device_inputs, max_new_tokens, num_grid_tokens, params, static_cache
        )


@torch.no_grad()
def decode_first_tokens(
    pipeline,
    prompts: list[str],
    height: int,
    width: int,
    params: SamplingParams,
    seed: int,
    num_steps: int,
    decoding: str = "loop",
    compile: bool = False,
) -> Tensor:
    """The first `num_steps` image tokens [B, num_steps] (CPU) of `sample_image_tokens`' rollout.

    The same draws as the whole rollout's first `num_steps` (tests/test_ar_logprobs.py), for timing decoding
    over a fixed number of steps. The loop keeps the whole rollout's KV cache (the same step, and with
    `compile` the same graph, as a whole image at this batch and size) and stops after `num_steps` draws;
    generate() is asked for `num_steps` new tokens.
    """
    _check_decoding(decoding, False, compile)
    inputs, grid_sizes = _rollout_inputs(pipeline, prompts, height, width)
    num_grid_tokens = sum(grid_sizes)
    if not 0 < num_steps <= num_grid_tokens:
        raise ValueError(f"num_steps must be in [1, {num_grid_tokens}] at {height}x{width}, got {num_steps}.")
    model = pipeline.vision_language_encoder
    if decoding == "loop":
        lengths, stop_after = (num_grid_tokens + 1, num_grid_tokens), num_steps
    else:
        lengths, stop_after = (num_steps, num_steps), None
    sequences, _, _ = _decode(model, inputs, *lengths, params, seed, decoding, False, compile, stop_after)
    num_prompt_tokens = inputs["input_ids"].shape[1]
    return sequences[:, num_prompt_tokens : num_prompt_tokens + num_steps]


def _decode_with_generate(
    model, inputs: dict[str, Tensor], max_new_tokens: int, num_grid_tokens: int, params, static_cache: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' generate(): (sequences [B, L], positions [3, B, L], log-probs [B, grid tokens]), CPU."""
    batch_size, num_prompt_tokens = inputs["input_ids"].shape
    total_length = num_prompt_tokens + max_new_tokens
    recorded_positions: list[Tensor] = []

    def record_positions(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        recorded_positions.append(None if position_ids is None else position_ids.clone())

    hook = model.get_decoder().register_forward_pre_hook(record_positions, with_kwargs=True)
    try:
        outputs = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            logits_processor=LogitsProcessorList([_SamplingLogitsProcessor(params)]),
            output_scores=True,
            return_dict_in_generate=True,
            **_NEUTRAL_GENERATION_KWARGS,
            **generation_speed_kwargs(static_cache),
        )
    finally:
        hook.remove()

    sequences = outputs.sequences.cpu()
    if sequences.shape != (batch_size, total_length):
        raise RuntimeError(
            f"generate() returned {tuple(sequences.shape)} tokens, expected {(batch_size, total_length)}: a "
            "sequence ended early (image-end sampled?). Set SamplingParams.codebook_size to the DiT's prior "
            "vocabulary size so that only codebook tokens can be sampled."
        )

    # Positions: prefill (3, B, L0), then one (3, B, 1) per decode step. The last token is sampled but never
    # fed back, so generate() used no position for it; its column repeats the previous one and is never read.
    if any(pos is None or pos.dim() != 3 or pos.shape[0] != 3 for pos in recorded_positions):
        raise RuntimeError(
            "transformers no longer passes (3, B, S) M-RoPE position_ids to GLM-Image's text model during "
            "generate(); glm_training.rollout.ar needs updating for this transformers version."
        )
    position_ids = torch.cat([pos.cpu() for pos in recorded_positions], dim=-1)
    position_ids = torch.cat([position_ids, position_ids[:, :, -1:]], dim=-1)

    log_probs = torch.zeros(batch_size, num_grid_tokens, dtype=torch.float32)
    generated = sequences[:, num_prompt_tokens:]
    for step in range(num_grid_tokens):
        step_log_probs = torch.log_softmax(outputs.scores[step].float(), dim=-1).cpu()
        log_probs[:, step] = step_log_probs.gather(-1, generated[:, step : step + 1]).squeeze(-1)
    return sequences, position_ids, log_probs


def image_token_positions(prompt_positions: Tensor, prompt_mask: Tensor, grids_thw: Tensor) -> Tensor:
    """M-RoPE positions [3, B, N + 1] of the tokens a text-to-image rollout generates.

    `prompt_positions` [3, B, L0]: the prompt's (GLM-Image's `get_rope_index`); `prompt_mask` [B, L0];
    `grids_thw` [B, G, 3]: each sample's target grids as the processor lists them (large first). Generation
    writes the grids in reverse order, each laid out in 2D from the next free position `p` (temporal `p`,
    height `p + row`, width `p + column`; then `p += max(h, w)`), and ends with one token at `p` on all three
    rows: GLM-Image's decode-time layout (transformers' `GlmImageModel.get_rope_index`). They depend only on
    the grids, so a rollout computes them before its first step; tests/test_ar_logprobs.py checks them against
    the positions generate() feeds the model.
    """
    columns = []
    for b in range(prompt_mask.shape[0]):
        valid = prompt_mask[b].bool()
        start = int(prompt_positions[:, b, valid].max()) + 1
        rows = []
        for _, h, w in reversed(grids_thw[b].tolist()):
            row = torch.arange(h).repeat_interleave(w)
            col = torch.arange(w).repeat(h)
            rows.append(torch.stack([torch.full((h * w,), start), start + row, start + col]))
            start += max(h, w)
        rows.append(torch.full((3, 1), start))
        columns.append(torch.cat(rows, dim=-1))
    return torch.stack(columns, dim=1).to(prompt_positions.device, prompt_positions.dtype)


def _decode_loop(
    model,
    inputs: dict[str, Tensor],
    max_new_tokens: int,
    num_grid_tokens: int,
    params,
    compile: bool,
    stop_after: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The project's decoding loop: (sequences [B, L], positions [3, B, L], log-probs [B, grid tokens]), CPU.

    The same computation as generate()'s sampling loop, without its per-step machinery: the prompt is
    prefilled once (`logits_to_keep=1`), then each step feeds the last token with its precomputed position
    into a KV cache allocated for the whole sequence (transformers' `StaticCache`), takes the last logits in
    float32, applies `_filtered_logits`, draws with `torch.multinomial` on their softmax (generate()'s draw,
    one per step, so the RNG stream is the same) and keeps only the drawn token's log-prob. The last token is
    drawn but never fed back, as in generate(). Every step's inputs are fixed-shape buffers updated in place,
    so that `compile` can capture the decoding step as one graph (torch.compile; "reduce-overhead", i.e. CUDA
    graphs, on CUDA); sampling stays eager so that the draws are generate()'s. `stop_after` ends the loop
    after that many draws (the later columns stay 0): `decode_first_tokens`.
    """
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    device = input_ids.device
    batch_size, num_prompt_tokens = input_ids.shape
    total_length = num_prompt_tokens + max_new_tokens
    forward_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}

    prompt_positions, _ = model.model.get_rope_index(
        input_ids,
        image_grid_thw=inputs["image_grid_thw"],
        images_per_sample=inputs.get("images_per_sample"),
        attention_mask=attention_mask,
    )
    grids = inputs["image_grid_thw"].view(batch_size, -1, 3)
    positions = torch.cat(
        [prompt_positions, image_token_positions(prompt_positions, attention_mask, grids.cpu())], dim=-1
    )
    cache = _RolloutCache(config=model.config.get_text_config(decoder=True), max_cache_len=total_length)
    sequences = torch.cat([input_ids, input_ids.new_zeros(batch_size, max_new_tokens)], dim=1)
    log_probs = torch.zeros(batch_size, num_grid_tokens, dtype=torch.float32, device=device)

    outputs = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions[:, :, :num_prompt_tokens],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **forward_inputs,
    )
    logits = outputs.logits[:, -1].to(dtype=torch.float32, copy=True)
    del outputs

    # The decoding step's inputs: fixed shapes and storage, refilled in place before each call. The attention
    # mask over the preallocated cache, [B, 1, 1, L] (True = attend), is the one transformers would build from
    # the 2D mask at every step (the prompt's padding, and the cache up to the current token); prepared here,
    # it opens one column a step, and the model takes it as given.
    step_ids = input_ids.new_zeros(batch_size, 1)
    step_positions = positions.new_zeros(3, batch_size, 1)
    step_cache_position = torch.zeros(1, dtype=torch.long, device=device)
    step_mask = torch.zeros(batch_size, 1, 1, total_length, dtype=torch.bool, device=device)
    step_mask[:, 0, 0, :num_prompt_tokens] = attention_mask.bool()

    def decode_step(ids: Tensor, position_ids: Tensor, cache_position: Tensor, mask: Tensor) -> Tensor:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=cache_position,
        )
        return out.logits[:, -1].to(dtype=torch.float32, copy=True)

    step_fn = _compiled_step(decode_step, device) if compile else decode_step
    last_step = max_new_tokens - 1 if stop_after is None else stop_after - 1
    for step in range(max_new_tokens):
        filtered = _filtered_logits(logits, params)
        tokens = torch.multinomial(torch.softmax(filtered, dim=-1), num_samples=1)
        column = num_prompt_tokens + step
        sequences[:, column] = tokens[:, 0]
        if step < num_grid_tokens:
            log_probs[:, step] = torch.log_softmax(filtered, dim=-1).gather(-1, tokens)[:, 0]
        if step == last_step:
            break
        step_ids.copy_(tokens)
        step_positions.copy_(positions[:, :, column : column + 1])
        step_cache_position.fill_(column)
        step_mask[:, 0, 0, column] = True
        logits = step_fn(step_ids, step_positions, step_cache_position, step_mask)
    # As generate() records them: the last token is never fed back, so its column repeats the previous one.
    positions[:, :, -1] = positions[:, :, -2]
    return sequences.cpu(), positions.cpu(), log_probs.cpu()


class _AutocastStaticLayer(StaticLayer):
    """transformers' `StaticLayer`, holding the values in the keys' dtype.

    Under autocast (bf16 compute of fp32 weights, `trainer.mixed_precision=bf16`) GLM-Image's keys leave the
    rotary embedding in float32 while the values leave their projection in bfloat16; `StaticLayer` allocates
    both in the first keys' dtype and then refuses the values. Upcasting them is exact, and attention under
    autocast casts both back to bf16, so it computes what it would with a growing cache of mixed dtypes.
    Without autocast both already share a dtype and nothing changes.
    """

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return super().update(key_states, value_states.to(key_states.dtype), *args, **kwargs)


class _RolloutCache(StaticCache):
    """The decoding loop's preallocated KV cache: `StaticCache` with `_AutocastStaticLayer` layers."""

    def __init__(self, config, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        if any(type(layer) is not StaticLayer for layer in self.layers):
            kinds = sorted({type(layer).__name__ for layer in self.layers})
            raise NotImplementedError(
                f"the decoding loop's cache supports full-attention layers only, got {kinds}."
            )
        self.layers = [_AutocastStaticLayer(max_cache_len=max_cache_len) for _ in self.layers]


def _compiled_step(decode_step, device: torch.device):
    """torch.compile of the decoding step: CUDA graphs on CUDA ("reduce-overhead"), inductor elsewhere.
    Fixed shapes (`dynamic=False`): one graph for every step of a rollout of a given batch and length."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(decode_step, mode=mode, dynamic=False, fullgraph=False)


@contextlib.contextmanager
def _contiguous_head_input(model: nn.Module) -> Iterator[None]:
    """Hand the LM head (`lm_head`, wrapped or not) a contiguous input inside the block.

    `logits_to_keep` gives the head a slice of the hidden states, a strided view. matmul folds a strided
    [B, T, H] input into one [B*T, H] GEMM only when its weight requires grad (a policy trained in full);
    a frozen head (the KL reference, or LoRA's) multiplies it sample by sample instead, and the two GEMMs
    may round differently. Contiguous, both fold into the same GEMM, so the first step's KL is exactly 0.
    """
    heads = [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "lm_head"]
    handles = [
        head.register_forward_pre_hook(lambda _, args: tuple(a.contiguous() for a in args)) for head in heads
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def teacher_forced_log_probs(model: nn.Module, samples: ARSamples, params: SamplingParams) -> Tensor:
    """Log-probs [B, L] (float32, on the model's device, differentiable) of the sampled tokens.

    One forward pass over prompt + generated tokens with the positions, attention mask and grids generation
    used, then `process_logits` with `keep_ids` = the tokens themselves. 0 where `completion_mask` is False.
    Only the positions up to the last completion token are fed, and logits are computed only for the
    completion span (`logits_to_keep`). `model` may be wrapped (DDP, peft): it is called with keyword
    arguments only.
    """
    device = _module_device(model)
    completion_columns = samples.completion_mask.any(dim=0).nonzero().squeeze(-1)
    if completion_columns.numel() == 0:
        raise ValueError("samples.completion_mask is empty: no generated tokens to score.")
    first, last = int(completion_columns[0]), int(completion_columns[-1])
    num_scored = last - first + 1
    # Logits at position i predict token i + 1: feeding tokens [0, last) yields the predictions of
    # tokens [first, last] in the final `num_scored` positions.
    with _contiguous_head_input(model):
        outputs = model(
            input_ids=samples.input_ids[:, :last].to(device),
            attention_mask=samples.attention_mask[:, :last].to(device),
            position_ids=samples.position_ids[:, :, :last].to(device),
            image_grid_thw=samples.image_grid_thw.to(device),
            logits_to_keep=num_scored,
            use_cache=False,
            **{key: value.to(device) for key, value in samples.extra.items()},
        )
    logits_btv = outputs.logits
    # Where the logits are: a module whose weights live in host memory (FSDP's CPU offload) computes
    # on the accelerator.
    device = logits_btv.device
    targets_bt = samples.input_ids[:, first : last + 1].to(device)
    log_probs_btv = process_logits(logits_btv, params, keep_ids_bt=targets_bt)
    log_probs_bt = log_probs_btv.gather(-1, targets_bt[..., None]).squeeze(-1)
    mask_bt = samples.completion_mask[:, first : last + 1].to(device)
    # where, not multiply: a filtered-out token outside the mask would give -inf * 0 = nan.
    log_probs_bt = torch.where(mask_bt, log_probs_bt, 0.0)
    batch_size, length = samples.input_ids.shape
    return torch.cat(
        [
            log_probs_bt.new_zeros(batch_size, first),
            log_probs_bt,
            log_probs_bt.new_zeros(batch_size, length - last - 1),
        ],
        dim=1,
    )


# ---------------------------------------------------------------------------------------------------------
# Per-sample records: how samples travel between ranks (dynamic sampling) and are re-batched for training.


def split_samples(samples: ARSamples) -> list[dict[str, Tensor]]:
    """One record per sequence, left padding stripped, every tensor on CPU (safe to send to other ranks)."""
    num_grids = samples.image_grid_thw.shape[0] // samples.input_ids.shape[0]
    records = []
    for b in range(samples.input_ids.shape[0]):
        keep = samples.attention_mask[b].bool()
        record = {
            "input_ids": samples.input_ids[b, keep],
            "position_ids": samples.position_ids[:, b, keep],
            "completion_mask": samples.completion_mask[b, keep],
            "sampling_log_probs": samples.sampling_log_probs[b, keep],
            "prior_token_ids": samples.prior_token_ids[b],
            "image_grid_thw": samples.image_grid_thw[b * num_grids : (b + 1) * num_grids],
        }
        record.update({f"extra.{k}": v[b] for k, v in samples.extra.items()})
        records.append({k: v.detach().cpu() for k, v in record.items()})
    return records


def collate_samples(records: list[dict[str, Tensor]], pad_token_id: int) -> ARSamples:
    """Stack records into one left-padded batch (the layout generation used; pad positions are 1, as HF's)."""
    length = max(r["input_ids"].shape[0] for r in records)

    def left_pad(t: Tensor, value, dim: int = -1) -> Tensor:
        missing = length - t.shape[dim]
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([torch.full(shape, value, dtype=t.dtype), t], dim=dim)

    return ARSamples(
        input_ids=torch.stack([left_pad(r["input_ids"], pad_token_id) for r in records]),
        attention_mask=torch.stack([left_pad(torch.ones_like(r["input_ids"]), 0) for r in records]),
        position_ids=torch.stack([left_pad(r["position_ids"], 1) for r in records], dim=1),
        completion_mask=torch.stack([left_pad(r["completion_mask"], False) for r in records]),
        sampling_log_probs=torch.stack([left_pad(r["sampling_log_probs"], 0.0) for r in records]),
        prior_token_ids=torch.stack([r["prior_token_ids"] for r in records]),
        image_grid_thw=torch.cat([r["image_grid_thw"] for r in records]),
        extra={
            k.removeprefix("extra."): torch.stack([r[k] for r in records])
            for k in records[0]
            if k.startswith("extra.")
        },
    )

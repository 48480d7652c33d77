"""GRPO/DAPO rollout for the GLM-Image AR model: sample image tokens, record their log-probs, recompute them.

GLM-Image's AR model (`GlmImageForConditionalGeneration`, the pipeline's `vision_language_encoder`) writes,
for a text prompt, a small preview grid of image tokens and then the large grid (H/32 x W/32) that the DiT
decodes; `generate()` runs for (preview + large) + 1 steps and the last token is thrown away. For GRPO
(DeepSeekMath, arXiv 2402.03300) and DAPO (arXiv 2503.14476) the policy is the distribution those tokens are
*sampled* from, and a token-level policy-gradient loss needs three pieces (this module holds the second):

* `process_logits` (`ar_logits.py`): logits -> log-probs of the sampling distribution (codebook mask,
  temperature, top-k, top-p, with the order and tie rules of transformers' `TemperatureLogitsWarper`,
  `TopKLogitsWarper`, `TopPLogitsWarper`).
* `sample_image_tokens`: the pipeline's own `generate()` call, with that processing as its only logits
  processor, recording per-token log-probs and the M-RoPE positions the model used.
* `teacher_forced_log_probs` (`algorithms/grpo/log_probs.py`): the same log-probs recomputed with gradients
  in one forward pass over the whole sequence.

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
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from glm_training.pipeline.ar_attention import packed_gqa
from glm_training.pipeline.ar_generate import check_generation_config, decode_with_generate
from glm_training.pipeline.ar_logits import SamplingParams, filtered_logits
from glm_training.pipeline.ar_step import DecodeState, cache_and_step, decoding_mask

# sample_image_tokens' decoding paths: the project's own loop (default) and transformers' generate().
DECODING_PATHS = ("loop", "generate")


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


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


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
    state: DecodeState | None = None,
    pad_to_multiple_of: int | None = None,
    packed_attention: bool = False,
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

    A sampler that decodes again and again (`pipeline/ar_sampler.py`) passes its `DecodeState`, so the loop
    keeps its KV cache and compiled step from one call to the next, and `pad_to_multiple_of`, which
    left-pads the prompts to a multiple of that many tokens so that calls share a few shapes;
    `packed_attention` runs the loop's per-token steps with `ar_attention.PACKED_GQA` (the same attention up
    to float rounding, without repeating the key/value heads).
    """
    _check_decoding(decoding, static_cache, compile)
    if state is not None and decoding != "loop":
        raise ValueError("a DecodeState keeps the decoding loop's cache; it needs decoding='loop'.")
    inputs, grid_sizes = _rollout_inputs(pipeline, prompts, height, width, pad_to_multiple_of)
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
        state=state,
        packed_attention=packed_attention,
    )
    if position_ids.shape != (3, batch_size, total_length):
        raise RuntimeError(
            f"Positions of shape {tuple(position_ids.shape)}, expected {(3, batch_size, total_length)}; "
            "glm_training.pipeline.ar needs updating for this transformers version."
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
    pipeline, prompts: list[str], height: int, width: int, pad_to_multiple_of: int | None = None
) -> tuple[dict[str, Tensor], list[int]]:
    """A text-to-image rollout's AR inputs (CPU) and its target grids' token counts, large grid first.

    Decoding writes the grids in reverse order (preview first), then one extra token. `pad_to_multiple_of`:
    the prompts left-padded to a multiple of that many tokens (`pad_prompts`).
    """
    if height % 32 or width % 32:
        raise ValueError(f"height and width must be multiples of 32, got {height}x{width}.")
    if not prompts:
        raise ValueError("prompts is empty.")
    check_generation_config(pipeline.vision_language_encoder)
    inputs = chat_inputs(pipeline, prompts, height, width)
    if pad_to_multiple_of:
        inputs = pad_prompts(inputs, pad_to_multiple_of, pipeline.processor.tokenizer.pad_token_id)
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


def pad_prompts(inputs: dict[str, Tensor], multiple: int, pad_token_id: int) -> dict[str, Tensor]:
    """`inputs` with `input_ids` and `attention_mask` left-padded to a multiple of `multiple` tokens.

    Left padding is masked out and the positions are computed from the mask, so the model computes the same
    logits for the prompt's own tokens (up to the float rounding of attention over more, masked, columns)."""
    length = inputs["input_ids"].shape[1]
    extra = -length % multiple
    if not extra:
        return inputs
    padded = dict(inputs)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    padded["input_ids"] = torch.cat([ids.new_full((ids.shape[0], extra), pad_token_id), ids], dim=1)
    padded["attention_mask"] = torch.cat([mask.new_zeros(mask.shape[0], extra), mask], dim=1)
    return padded


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
    state: DecodeState | None = None,
    packed_attention: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Seeded decoding on the model's device by `decoding`'s path: (sequences, positions, log-probs), CPU."""
    device = module_device(model)
    device_inputs = {key: value.to(device) for key, value in inputs.items()}
    fork_devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=fork_devices, device_type=device.type if fork_devices else "cuda"):
        torch.manual_seed(seed)
        if decoding == "loop":
            return _decode_loop(
                model,
                device_inputs,
                max_new_tokens,
                num_grid_tokens,
                params,
                compile,
                stop_after,
                state,
                packed_attention,
            )
        return decode_with_generate(
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
    packed_attention: bool = False,
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
    sequences, _, _ = _decode(
        model,
        inputs,
        *lengths,
        params,
        seed,
        decoding,
        False,
        compile,
        stop_after,
        packed_attention=packed_attention,
    )
    num_prompt_tokens = inputs["input_ids"].shape[1]
    return sequences[:, num_prompt_tokens : num_prompt_tokens + num_steps]


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
    state: DecodeState | None = None,
    packed_attention: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The project's decoding loop: (sequences [B, L], positions [3, B, L], log-probs [B, grid tokens]), CPU.

    The same computation as generate()'s sampling loop, without its per-step machinery: the prompt is
    prefilled once (`logits_to_keep=1`), then each step feeds the last token with its precomputed position
    into a KV cache allocated for the whole sequence (transformers' `StaticCache`), takes the last logits in
    float32, applies `filtered_logits`, draws with `torch.multinomial` on their softmax (generate()'s draw,
    one per step, so the RNG stream is the same) and keeps only the drawn token's log-prob. The last token is
    drawn but never fed back, as in generate(). Every step's inputs are fixed-shape buffers updated in place,
    so that `compile` can capture the decoding step as one graph (torch.compile; "reduce-overhead", i.e. CUDA
    graphs, on CUDA); sampling stays eager so that the draws are generate()'s. `stop_after` ends the loop
    after that many draws (the later columns stay 0): `decode_first_tokens`. `state`: the cache and step
    kept from an earlier call of the same shape (`DecodeState`); `packed_attention`: the per-token steps
    attend with `ar_attention.PACKED_GQA`.
    """
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    device = input_ids.device
    batch_size, num_prompt_tokens = input_ids.shape
    total_length = num_prompt_tokens + max_new_tokens
    forward_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    step_mask, attend = decoding_mask(model, attention_mask, total_length)  # refuses a model it cannot serve

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
    cache, step_fn = cache_and_step(model, state, batch_size, total_length, compile, device)
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
    # mask over the preallocated cache, [B, 1, 1, L] (`step_mask`), is the one transformers would build from
    # the 2D mask at every step (the prompt's padding, and the cache up to the current token); prepared here,
    # it opens one column a step, and the model takes it as given.
    step_ids = input_ids.new_zeros(batch_size, 1)
    step_positions = positions.new_zeros(3, batch_size, 1)
    step_cache_position = torch.zeros(1, dtype=torch.long, device=device)
    last_step = max_new_tokens - 1 if stop_after is None else stop_after - 1
    with packed_gqa(model) if packed_attention else contextlib.nullcontext():
        for step in range(max_new_tokens):
            filtered = filtered_logits(logits, params)
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
            step_mask[:, 0, 0, column] = attend
            logits = step_fn(step_ids, step_positions, step_cache_position, step_mask)
    # As generate() records them: the last token is never fed back, so its column repeats the previous one.
    positions[:, :, -1] = positions[:, :, -2]
    return sequences.cpu(), positions.cpu(), log_probs.cpu()


# ---------------------------------------------------------------------------------------------------------
# Per-sample records: how samples travel between ranks (dynamic sampling) and are re-batched for training.

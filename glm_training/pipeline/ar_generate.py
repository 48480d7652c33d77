"""The "generate" decoding path of `pipeline/ar.py`: transformers' `generate()` with the project's sampling as
its only logits processor, every other processor neutralised, and the M-RoPE positions recorded by a hook."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import LogitsProcessorList

from glm_training.pipeline.ar_logits import SamplingLogitsProcessor

# Passed to generate() so that transformers adds no logits processor of its own: the only change to the
# logits is `SamplingLogitsProcessor`. Each value is the one that makes transformers skip the processor.
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


def generation_speed_kwargs(static_cache: bool) -> dict[str, Any]:
    """generate() arguments for a static KV cache (transformers' `cache_implementation="static"`).

    It changes neither the logits processor, the sampling nor the RNG stream, only the cache's memory layout.
    transformers' automatic compilation (on by default with a static cache on CUDA) is switched off: the
    compiled decoding step is the loop's (`sample_image_tokens(decoding="loop", compile=True)`).
    """
    if not static_cache:
        return {}
    return {"cache_implementation": "static", "disable_compile": True}


def check_generation_config(model) -> None:
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


def decode_with_generate(
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
            logits_processor=LogitsProcessorList([SamplingLogitsProcessor(params)]),
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
            "generate(); glm_training.pipeline.ar_generate needs updating for this transformers version."
        )
    position_ids = torch.cat([pos.cpu() for pos in recorded_positions], dim=-1)
    position_ids = torch.cat([position_ids, position_ids[:, :, -1:]], dim=-1)

    log_probs = torch.zeros(batch_size, num_grid_tokens, dtype=torch.float32)
    generated = sequences[:, num_prompt_tokens:]
    for step in range(num_grid_tokens):
        step_log_probs = torch.log_softmax(outputs.scores[step].float(), dim=-1).cpu()
        log_probs[:, step] = step_log_probs.gather(-1, generated[:, step : step + 1]).squeeze(-1)
    return sequences, position_ids, log_probs

"""How GLM-Image's AR model samples image tokens: `SamplingParams` (codebook mask, temperature, top-k, top-p)
resolved from the pipeline's generation config, and `process_logits`, logits -> log-probs of that sampling
distribution with the order and tie rules of transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper` and
`TopPLogitsWarper`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import LogitsProcessor


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


def filtered_logits(logits: Tensor, params: SamplingParams, keep_ids: Tensor | None = None) -> Tensor:
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
    return torch.log_softmax(filtered_logits(logits_btv, params, keep_ids_bt), dim=-1)


class SamplingLogitsProcessor(LogitsProcessor):
    """The whole sampling transform of `SamplingParams`, as the one logits processor of `generate()`."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # Filtered logits rather than log-probs: generate() samples from softmax(scores), which then matches
        # transformers' own warpers bit for bit.
        return filtered_logits(scores, self.params)


# transformers' defaults for the sampling knobs that neither the pipeline nor a generation_config may set:
# GlmImagePipeline passes only do_sample=True, so an unset top_k means top-k 50.
HF_DEFAULT_TEMPERATURE = 1.0


HF_DEFAULT_TOP_P = 1.0


HF_DEFAULT_TOP_K = 50

"""AR rollout: sampling log-probs vs teacher forcing, grids and prior tokens, HF warper parity, positions."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from diffusers import GlmImagePipeline
from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from glm_training.algorithms.grpo.log_probs import teacher_forced_log_probs
from glm_training.models.tiny import NUM_VISION_TOKENS
from glm_training.pipeline.ar import (
    DECODING_PATHS,
    decode_first_tokens,
    image_token_positions,
    sample_image_tokens,
)
from glm_training.pipeline.ar_generate import generation_speed_kwargs
from glm_training.pipeline.ar_logits import (
    HF_DEFAULT_TEMPERATURE,
    HF_DEFAULT_TOP_K,
    HF_DEFAULT_TOP_P,
    SamplingParams,
    process_logits,
    resolve_sampling_params,
)

# Two prompts of different lengths, each twice (a GRPO group of 2): the batch is left-padded.
PROMPTS = ["a red cat", "a sign that says 'hello there'"] * 2
HEIGHT = WIDTH = 64  # large grid 2x2, preview grid 16x16


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir) -> GlmImagePipeline:
    return GlmImagePipeline.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def samples(pipeline):
    """The default decoding path (the project's loop)."""
    params = SamplingParams.from_pipeline(pipeline)
    return sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0)


@pytest.fixture(scope="module")
def generated(pipeline):
    """The same rollout through transformers' generate()."""
    params = SamplingParams.from_pipeline(pipeline)
    return sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0, decoding="generate")


def num_prompt_tokens(samples) -> int:
    return int(samples.completion_mask.long().argmax(dim=1)[0])


# ----------------------------------------------------------------------------------------------------------
# process_logits


def hf_log_probs(logits_nv: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """transformers' warpers in generate()'s order, each only where generate() would add it."""
    scores = logits_nv.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 20, 1.0), (0.9, 50, 0.75), (1.0, 5, 0.3), (2.0, 64, 0.95)],
)
def test_process_logits_matches_hf_warpers_bitwise(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    # Values on a grid of 0.25 produce many exact ties, at the top-k boundary and inside the top-p sort.
    logits_btv = (torch.randn(3, 7, 64, generator=generator) * 8).round() / 4
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)

    ours = process_logits(logits_btv, params)
    # Row by row, as generate() sees them ([B, V] per step), and all rows at once.
    steps = [hf_log_probs(logits_btv[:, t], temperature, top_k, top_p) for t in range(7)]
    per_step = torch.stack(steps, dim=1)
    flat = hf_log_probs(logits_btv.reshape(21, 64), temperature, top_k, top_p).view(3, 7, 64)
    assert ours.dtype == torch.float32 and ours.shape == (3, 7, 64)
    torch.testing.assert_close(ours, per_step, rtol=0, atol=0)
    torch.testing.assert_close(ours, flat, rtol=0, atol=0)


def test_process_logits_golden_values():
    # probs 0.1, 0.2, 0.3, 0.4 over 4 tokens.
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0]).log().view(1, 1, 4)
    # top_p 0.5: ascending cumulative probs 0.1, 0.3, 0.6, 1.0; those <= 1 - 0.5 go,
    # leaving probs 0.3 and 0.4 -> 3/7 and 4/7.
    expected_top_p = torch.tensor([-math.inf, -math.inf, math.log(3 / 7), math.log(4 / 7)])
    torch.testing.assert_close(process_logits(logits, SamplingParams(top_p=0.5))[0, 0], expected_top_p)
    # top_k 3: keep 2, 3, 4 -> 2/9, 3/9, 4/9.
    expected_top_k = torch.tensor([-math.inf, math.log(2 / 9), math.log(3 / 9), math.log(4 / 9)])
    torch.testing.assert_close(process_logits(logits, SamplingParams(top_k=3))[0, 0], expected_top_k)
    # temperature 0.5 squares the probabilities: 1, 4, 9, 16 over 30.
    expected_temp = torch.tensor([1.0, 4.0, 9.0, 16.0]).div(30).log()
    torch.testing.assert_close(process_logits(logits, SamplingParams(temperature=0.5))[0, 0], expected_temp)
    # codebook 2 leaves tokens 0 and 1: 1/3, 2/3.
    expected_codebook = torch.tensor([math.log(1 / 3), math.log(2 / 3), -math.inf, -math.inf])
    codebook = process_logits(logits, SamplingParams(codebook_size=2))[0, 0]
    torch.testing.assert_close(codebook, expected_codebook)


def test_process_logits_gradient():
    # d log p_i / d logit_j = (1[i == j] - p_j) / T on kept tokens, 0 on filtered ones.
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0]).log().view(1, 1, 4).requires_grad_()
    process_logits(logits, SamplingParams(temperature=0.5, top_k=3))[0, 0, 3].backward()
    probs = torch.tensor([0.0, 4.0, 9.0, 16.0]) / 29
    expected = (torch.tensor([0.0, 0.0, 0.0, 1.0]) - probs) / 0.5
    expected[0] = 0.0
    torch.testing.assert_close(logits.grad[0, 0], expected)


def test_keep_ids_exempts_recorded_tokens_from_filters_only():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).view(1, 1, 6)
    params = SamplingParams(top_k=2, codebook_size=5)  # top-2 of the codebook: ids 3 and 4
    plain = process_logits(logits, params)[0, 0]
    assert torch.isinf(plain[:3]).all() and torch.isfinite(plain[3:5]).all() and plain[5] == -math.inf

    kept = process_logits(logits, params, keep_ids_bt=torch.tensor([[0]]))[0, 0]
    assert torch.isfinite(kept[0]) and torch.isinf(kept[1:3]).all()
    torch.testing.assert_close(kept[[0, 3, 4]].exp().sum(), torch.tensor(1.0))
    # The codebook mask is never lifted.
    assert process_logits(logits, params, keep_ids_bt=torch.tensor([[5]]))[0, 0, 5] == -math.inf
    # Keeping a token that survives the filters anyway changes nothing.
    torch.testing.assert_close(process_logits(logits, params, keep_ids_bt=torch.tensor([[4]]))[0, 0], plain)

    top_p = SamplingParams(top_p=0.5)
    kept_p = process_logits(logits, top_p, keep_ids_bt=torch.tensor([[1]]))[0, 0]
    assert torch.isfinite(kept_p[1]) and torch.isinf(process_logits(logits, top_p)[0, 0, 1])


def test_codebook_mask_on_wide_head():
    # Real-model layout in small: a 12-logit head whose ids >= 8 are specials.
    logits = torch.randn(2, 3, 12, generator=torch.Generator().manual_seed(1))
    log_probs = process_logits(logits, SamplingParams(temperature=0.8, top_p=0.9, codebook_size=8))
    assert (log_probs[..., 8:] == -math.inf).all()
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 3))
    reference = process_logits(logits[..., :8], SamplingParams(temperature=0.8, top_p=0.9))
    torch.testing.assert_close(log_probs[..., :8], reference)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"codebook_size": 0}]
)
def test_sampling_params_validate(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_from_pipeline_resolves_hf_defaults(pipeline):
    # Guard: the pipeline passes only do_sample=True, so unset knobs fall back to transformers' defaults.
    defaults = GenerationConfig()._get_default_generation_params()
    assert (defaults["temperature"], defaults["top_p"], defaults["top_k"]) == (
        HF_DEFAULT_TEMPERATURE,
        HF_DEFAULT_TOP_P,
        HF_DEFAULT_TOP_K,
    )
    params = SamplingParams.from_pipeline(pipeline)
    assert params == SamplingParams(temperature=0.9, top_p=0.75, top_k=50, codebook_size=NUM_VISION_TOKENS)


def test_unset_sampling_knobs_are_the_pipelines_own(pipeline):
    own = SamplingParams.from_pipeline(pipeline)
    params, line = resolve_sampling_params(pipeline, None, None, None)
    assert params == own
    assert line == "AR sampling: temperature=0.9 top_p=0.75 top_k=50 (from the pipeline's generation config)"
    params, line = resolve_sampling_params(pipeline, 1.0, 1.0, 0)
    assert params == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, codebook_size=own.codebook_size)
    assert line == "AR sampling: temperature=1.0 top_p=1.0 top_k=0 (set)"
    params, line = resolve_sampling_params(pipeline, 1.3, None, 0)
    assert params == SamplingParams(temperature=1.3, top_p=0.75, top_k=0, codebook_size=own.codebook_size)
    assert line.endswith("(temperature, top_k set; top_p from the pipeline's generation config)")


# ----------------------------------------------------------------------------------------------------------
# sampling and teacher forcing


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=1.0),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=20),
    ],
    ids=["plain", "temp0.7-topp0.8", "temp1.3-topk20"],
)
def test_teacher_forced_matches_sampling_log_probs(pipeline, params):
    samples = sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=1)
    assert not samples.attention_mask[:, 0].all(), "the batch should be left-padded"
    with torch.no_grad():
        log_probs = teacher_forced_log_probs(pipeline.vision_language_encoder, samples, params)
    mask = samples.completion_mask
    assert log_probs.dtype == torch.float32 and log_probs.shape == samples.input_ids.shape
    assert torch.isfinite(log_probs).all() and (log_probs[~mask] == 0).all()
    assert (samples.sampling_log_probs[~mask] == 0).all()
    torch.testing.assert_close(log_probs[mask], samples.sampling_log_probs[mask], rtol=0, atol=1e-5)


def test_a_frozen_reference_scores_through_the_trained_policys_kernels(pipeline, samples):
    # The first step's KL is exactly 0 only if the frozen reference and the trained policy run the same
    # GEMMs: a frozen LM head given a strided slice of the hidden states would multiply it sample by sample
    # (bmm), a trained one folds it into one GEMM (mm), and the two may round differently on some CPUs.
    params = SamplingParams.from_pipeline(pipeline)
    policy = copy.deepcopy(pipeline.vision_language_encoder).requires_grad_(True)
    reference = copy.deepcopy(pipeline.vision_language_encoder).requires_grad_(False)

    def scored(model, grad: bool):
        with torch.set_grad_enabled(grad), torch.profiler.profile() as prof:
            log_probs = teacher_forced_log_probs(model, samples, params)
        return log_probs.detach(), Counter(
            e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm")
        )

    (policy_lp, policy_ops), (reference_lp, reference_ops) = scored(policy, True), scored(reference, False)
    assert policy_ops == reference_ops and "aten::bmm" not in reference_ops, (policy_ops, reference_ops)
    assert torch.equal(policy_lp, reference_lp)


def test_teacher_forced_is_deterministic_and_differentiable(pipeline, samples):
    model = pipeline.vision_language_encoder
    params = SamplingParams.from_pipeline(pipeline)
    model.zero_grad(set_to_none=True)
    try:
        first = teacher_forced_log_probs(model, samples, params)
        second = teacher_forced_log_probs(model, samples, params)
        assert torch.equal(first, second)
        assert (torch.exp(first - second)[samples.completion_mask] == 1).all()

        first[samples.completion_mask].mean().backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        assert grads["lm_head.weight"].abs().sum() > 0
        assert grads["model.language_model.embed_tokens.weight"].abs().sum() > 0
        # Left-padded rows must not leak nan into the gradients.
        assert all(torch.isfinite(grad).all() for grad in grads.values())
    finally:
        model.zero_grad(set_to_none=True)


# Preview grid (the processor's ~256-token grid of the same aspect ratio) + large grid (H/32 x W/32).
@pytest.mark.parametrize(
    "height, width, num_grid_tokens", [(64, 64, 16 * 16 + 2 * 2), (64, 96, 13 * 19 + 2 * 3)]
)
def test_completion_mask_covers_exactly_the_grid_tokens(pipeline, height, width, num_grid_tokens):
    samples = sample_image_tokens(pipeline, PROMPTS[:2], height, width, SamplingParams(), seed=0)
    grids = samples.image_grid_thw[: int(samples.extra["images_per_sample"][0])]
    max_new_tokens, _, _, _ = GlmImagePipeline._compute_generation_params(grids, is_text_to_image=True)
    # The pipeline's trailing extra token is not a completion token.
    assert num_grid_tokens == max_new_tokens - 1
    length = samples.input_ids.shape[1]
    prompt_len = length - max_new_tokens
    expected = torch.zeros_like(samples.completion_mask)
    expected[:, prompt_len : prompt_len + num_grid_tokens] = True
    assert torch.equal(samples.completion_mask, expected)
    assert samples.completion_mask.sum(1).tolist() == [num_grid_tokens] * 2
    assert samples.prior_token_ids.shape == (2, 4 * (height // 32) * (width // 32))


def test_prior_token_ids_match_pipeline_extraction(pipeline, samples):
    grids = samples.image_grid_thw[: int(samples.extra["images_per_sample"][0])]
    _, offset, token_h, token_w = GlmImagePipeline._compute_generation_params(grids, is_text_to_image=True)
    prompt_len = num_prompt_tokens(samples)
    for row in range(len(PROMPTS)):
        large = GlmImagePipeline._extract_large_image_tokens(
            samples.input_ids[row : row + 1], prompt_len, offset, token_h * token_w
        )
        expected = GlmImagePipeline._upsample_token_ids(large, token_h, token_w)
        assert torch.equal(samples.prior_token_ids[row : row + 1], expected)
    assert (samples.prior_token_ids < pipeline.transformer.config.prior_vq_quantizer_codebook_size).all()


def test_same_tokens_as_the_pipeline_for_the_same_seed(pipeline, samples):
    # `samples` used SamplingParams.from_pipeline and seed 0; the pipeline seeds torch from the generator.
    prior_token_ids, _, _ = pipeline.generate_prior_tokens(
        PROMPTS, HEIGHT, WIDTH, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(samples.prior_token_ids, prior_token_ids)


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone(pipeline, samples):
    params = SamplingParams.from_pipeline(pipeline)
    rng_state = torch.get_rng_state()
    again = sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert torch.equal(again.input_ids, samples.input_ids)
    assert torch.equal(again.sampling_log_probs, samples.sampling_log_probs)
    other = sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=1)
    assert not torch.equal(other.input_ids, samples.input_ids)


def test_model_generation_config_does_not_reshape_the_sampling_distribution(pipeline):
    # Knobs that would add transformers logits processors are neutralised per call: the recorded log-probs
    # still equal the teacher-forced ones computed from `params` alone.
    config = pipeline.vision_language_encoder.generation_config
    shaping = {"temperature": 0.3, "top_k": 3, "top_p": 0.3, "repetition_penalty": 1.5, "typical_p": 0.5}
    shaping |= {
        "no_repeat_ngram_size": 2,
        "epsilon_cutoff": 0.01,
        "eta_cutoff": 0.01,
        "renormalize_logits": True,
    }
    saved = {name: getattr(config, name) for name in shaping}
    params = SamplingParams(temperature=1.2)
    try:
        for name, value in shaping.items():
            setattr(config, name, value)
        samples = sample_image_tokens(pipeline, PROMPTS[:2], HEIGHT, WIDTH, params, seed=0)
    finally:
        for name, value in saved.items():
            setattr(config, name, value)
    with torch.no_grad():
        log_probs = teacher_forced_log_probs(pipeline.vision_language_encoder, samples, params)
    mask = samples.completion_mask
    torch.testing.assert_close(log_probs[mask], samples.sampling_log_probs[mask], rtol=0, atol=1e-5)


def test_rejects_generation_config_that_reshapes_logits(pipeline):
    config = pipeline.vision_language_encoder.generation_config
    config.min_p = 0.1
    try:
        with pytest.raises(ValueError, match="min_p"):
            sample_image_tokens(pipeline, PROMPTS[:1], HEIGHT, WIDTH, SamplingParams(), seed=0)
    finally:
        config.min_p = None


# ----------------------------------------------------------------------------------------------------------
# M-RoPE positions: the model internals the rollout relies on


def test_positions_guard(pipeline, generated):
    """Fails loudly if transformers changes what teacher forcing relies on.

    (1) `generate()` hands the text model (`get_decoder()`) (3, B, S) `position_ids`; `sample_image_tokens`
    records them. (2) They follow GLM-Image's layout: text positions count valid prompt tokens; each generated
    grid (preview first, then large) sits at one temporal position `p`, heights `p + row`, widths `p + col`,
    and the next grid starts at `p + max(h, w)`. (3) They agree with the model's own prefill computation
    (`get_rope_index` and its decode cache). (4) An explicit `position_ids` is used as given: the
    teacher-forced logits equal generate()'s, whereas the model's own positions for the full sequence are
    different.
    """
    samples = generated
    model = pipeline.vision_language_encoder
    assert model.get_decoder() is model.model.language_model
    positions = samples.position_ids
    batch_size, length = samples.input_ids.shape
    assert positions.shape == (3, batch_size, length)

    prompt_len = num_prompt_tokens(samples)
    for row in range(batch_size):
        valid = samples.attention_mask[row, :prompt_len].bool()
        num_valid = int(valid.sum())
        assert torch.equal(positions[:, row, :prompt_len][:, valid], torch.arange(num_valid).expand(3, -1))
        expected = []
        start = num_valid
        for h, w in [(16, 16), (2, 2)]:  # preview, then large (64x64)
            rows = torch.arange(h).repeat_interleave(w)
            cols = torch.arange(w).repeat(h)
            expected.append(torch.stack([torch.full((h * w,), start), start + rows, start + cols]))
            start += max(h, w)
        expected = torch.cat(expected, dim=1)
        generated = positions[:, row, prompt_len : prompt_len + expected.shape[1]]
        assert torch.equal(generated, expected)

    # (3) The model's own computation, as the prefill of generate() runs it.
    inner = model.model
    prompt_positions, _ = inner.get_rope_index(
        samples.input_ids[:, :prompt_len],
        image_grid_thw=samples.image_grid_thw,
        images_per_sample=samples.extra["images_per_sample"],
        attention_mask=samples.attention_mask[:, :prompt_len],
    )
    assert torch.equal(positions[:, :, :prompt_len], prompt_positions)
    decode_positions = inner._cached_decode_position_ids.permute(1, 0, 2)  # [3, B, max_new_tokens]
    assert torch.equal(positions[:, :, prompt_len:-1], decode_positions[:, :, :-1])

    # (4) Explicit positions are honoured; the model's own full-sequence positions are not generate()'s.
    params = SamplingParams.from_pipeline(pipeline)
    with torch.no_grad():
        log_probs = teacher_forced_log_probs(model, samples, params)
        mask = samples.completion_mask
        torch.testing.assert_close(log_probs[mask], samples.sampling_log_probs[mask], rtol=0, atol=1e-5)
        inputs = {
            "input_ids": samples.input_ids,
            "attention_mask": samples.attention_mask,
            "image_grid_thw": samples.image_grid_thw,
            **samples.extra,
        }
        own = model(**inputs, position_ids=None, use_cache=False).logits
        given = model(**inputs, position_ids=samples.position_ids, use_cache=False).logits
    # Sensitivity of the check above. Should this fail, transformers now derives generate()'s positions for a
    # full sequence itself; explicit positions stay correct, and this line can go.
    window = slice(prompt_len, length - 1)
    assert (own[:, window] - given[:, window]).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------------------
# decoding paths: the project's loop against generate(); generate()'s static KV cache; the compiled loop


def _assert_same_distribution(fast, reference, pipeline, params):
    """Same tokens; log-probs equal up to fp32 rounding; positions equal up to a per-sample shift.

    Not bitwise: the static cache attends over its preallocated length (masked), so the attention's sums
    are shaped differently (measured difference 4.8e-7); and transformers lays out a left-padded prompt's
    M-RoPE positions from the first column instead of the first real token, a constant shift per sample
    that rotary embeddings (relative) do not see.
    """
    assert torch.equal(fast.input_ids, reference.input_ids)
    assert torch.equal(fast.completion_mask, reference.completion_mask)
    mask = reference.completion_mask
    torch.testing.assert_close(
        fast.sampling_log_probs[mask], reference.sampling_log_probs[mask], rtol=0, atol=1e-5
    )
    attended = reference.attention_mask.bool()
    for b in range(fast.input_ids.shape[0]):
        shift = fast.position_ids[:, b, attended[b]] - reference.position_ids[:, b, attended[b]]
        assert (shift == shift[0, 0]).all()
    # The positions recorded are the ones the fast path used: teacher forcing reproduces its log-probs.
    with torch.no_grad():
        log_probs = teacher_forced_log_probs(pipeline.vision_language_encoder, fast, params)
    torch.testing.assert_close(log_probs[mask], fast.sampling_log_probs[mask], rtol=0, atol=1e-5)


def _assert_same_rollout(loop, generated, atol: float = 1e-6):
    """The loop's rollout is generate()'s: every field equal, log-probs within 1e-6.

    The log-probs are not bitwise equal: the loop's preallocated cache makes attention sum over the whole
    sequence length (masked), generate()'s dynamic one over the tokens so far (measured: up to 9.5e-7, i.e.
    two float32 steps at |log p| ~ 6).
    """
    for name in ("input_ids", "attention_mask", "position_ids", "completion_mask", "prior_token_ids"):
        assert torch.equal(getattr(loop, name), getattr(generated, name)), name
    assert torch.equal(loop.image_grid_thw, generated.image_grid_thw)
    assert loop.extra.keys() == generated.extra.keys()
    mask = generated.completion_mask
    assert (loop.sampling_log_probs[~mask] == 0).all()
    torch.testing.assert_close(loop.sampling_log_probs, generated.sampling_log_probs, rtol=0, atol=atol)


def test_the_decoding_loop_is_generates_rollout(samples, generated):
    assert not samples.attention_mask[:, 0].all(), "the batch should be left-padded"
    _assert_same_rollout(samples, generated)


@pytest.mark.parametrize("decoding", DECODING_PATHS)
def test_the_first_decoding_steps_are_the_rollouts_first_tokens(pipeline, samples, decoding):
    # What gpu_check times over a fixed number of steps: the same draws as the whole rollout's first ones.
    params = SamplingParams.from_pipeline(pipeline)
    first = decode_first_tokens(
        pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0, num_steps=5, decoding=decoding
    )
    start = num_prompt_tokens(samples)
    assert torch.equal(first, samples.input_ids[:, start : start + 5])
    with pytest.raises(ValueError, match="num_steps must be in"):
        decode_first_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0, num_steps=261)


# (prompts, height, width, sampling settings, seed): batch sizes 1 to 8 with left padding, three grid shapes,
# the filters alone and together.
DECODING_CASES = [
    (["a"], 96, 64, {"temperature": 1.0}, 11),
    (PROMPTS[:3], 64, 96, {"temperature": 1.3, "top_k": 20}, 5),
    (PROMPTS, 64, 64, {"temperature": 0.7, "top_p": 0.8}, 3),
    (PROMPTS * 2, 64, 64, {"temperature": 0.9, "top_p": 0.75, "top_k": 50}, 2),
]


@pytest.mark.parametrize("prompts, height, width, knobs, seed", DECODING_CASES, ids=["b1", "b3", "b4", "b8"])
def test_the_decoding_loop_draws_generates_tokens(pipeline, prompts, height, width, knobs, seed):
    codebook_size = pipeline.transformer.config.prior_vq_quantizer_codebook_size
    params = SamplingParams(**knobs, codebook_size=codebook_size)
    rollouts = {
        decoding: sample_image_tokens(pipeline, prompts, height, width, params, seed=seed, decoding=decoding)
        for decoding in DECODING_PATHS
    }
    _assert_same_rollout(rollouts["loop"], rollouts["generate"])
    # The recorded log-probs are the policy's: teacher forcing reproduces them.
    with torch.no_grad():
        log_probs = teacher_forced_log_probs(pipeline.vision_language_encoder, rollouts["loop"], params)
    mask = rollouts["loop"].completion_mask
    torch.testing.assert_close(log_probs[mask], rollouts["loop"].sampling_log_probs[mask], rtol=0, atol=1e-5)


def test_the_loop_equals_generate_with_a_static_cache(pipeline):
    # One prompt (no padding, so no position shift): both attend over a preallocated cache of the same length
    # and draw the same tokens. The log-probs are not compared bit for bit: the two are different code paths
    # into the model (the loop hands it a prepared boolean mask over the whole cache; generate() has the model
    # build its mask each step), and the attention kernel a CPU picks for each can sum in another order (an
    # AMD EPYC does: 4.8e-7 apart there). The bound is the decoding loop's requirement, 1e-6: a few float32
    # ulps at these log-probs' magnitudes (|log p| up to ~10).
    params = SamplingParams.from_pipeline(pipeline)
    loop = sample_image_tokens(pipeline, PROMPTS[:1], HEIGHT, WIDTH, params, seed=4)
    static = sample_image_tokens(
        pipeline, PROMPTS[:1], HEIGHT, WIDTH, params, seed=4, decoding="generate", static_cache=True
    )
    assert torch.equal(loop.input_ids, static.input_ids)
    torch.testing.assert_close(loop.sampling_log_probs, static.sampling_log_probs, rtol=0, atol=1e-6)


def test_image_token_positions_are_the_models_decode_layout(pipeline, generated):
    # Against GLM-Image's own decode-time layout (`get_rope_index`'s cache, as generate() uses it).
    prompt_len = num_prompt_tokens(generated)
    inner = pipeline.vision_language_encoder.model
    prompt_positions, _ = inner.get_rope_index(
        generated.input_ids[:, :prompt_len],
        image_grid_thw=generated.image_grid_thw,
        images_per_sample=generated.extra["images_per_sample"],
        attention_mask=generated.attention_mask[:, :prompt_len],
    )
    grids = generated.image_grid_thw.view(len(PROMPTS), -1, 3)
    positions = image_token_positions(prompt_positions, generated.attention_mask[:, :prompt_len], grids)
    assert torch.equal(positions, inner._cached_decode_position_ids.permute(1, 0, 2))


def test_static_cache_samples_the_same_tokens_and_log_probs(pipeline, generated):
    params = SamplingParams.from_pipeline(pipeline)
    assert not generated.attention_mask[:, 0].all(), "the batch should be left-padded"
    fast = sample_image_tokens(
        pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0, decoding="generate", static_cache=True
    )
    _assert_same_distribution(fast, generated, pipeline, params)


@pytest.mark.slow  # compiling the decoding step takes ~25 s on 2 CPU cores
def test_the_compiled_decoding_loop_draws_the_same_tokens(pipeline, samples):
    params = SamplingParams.from_pipeline(pipeline)
    compiled = sample_image_tokens(pipeline, PROMPTS, HEIGHT, WIDTH, params, seed=0, compile=True)
    for name in ("input_ids", "position_ids", "completion_mask", "prior_token_ids"):
        assert torch.equal(getattr(compiled, name), getattr(samples, name)), name
    # Inductor's kernels sum in their own order: equal up to float32 rounding.
    torch.testing.assert_close(compiled.sampling_log_probs, samples.sampling_log_probs, rtol=0, atol=1e-5)


def test_decoding_options_are_checked():
    assert generation_speed_kwargs(False) == {}
    # A static cache alone must not compile (transformers would, on CUDA, by default).
    assert generation_speed_kwargs(True) == {"cache_implementation": "static", "disable_compile": True}
    params = SamplingParams()
    for kwargs, needle in [
        ({"decoding": "beam"}, "decoding must be one of"),
        ({"decoding": "loop", "static_cache": True}, "always preallocates"),
        ({"decoding": "generate", "compile": True}, "compile applies to decoding='loop'"),
    ]:
        with pytest.raises(ValueError, match=needle):
            sample_image_tokens(None, PROMPTS, HEIGHT, WIDTH, params, seed=0, **kwargs)


def test_the_decoding_loop_masks_as_eager_attention_takes_it(tiny_model_dir):
    # Eager attention adds the mask to its scores: a boolean mask would add 1 and 0 and open every column of
    # the cache. The loop hands eager the additive mask transformers builds, so it draws generate()'s tokens.
    eager = GlmImagePipeline.from_pretrained(tiny_model_dir)
    eager.vision_language_encoder.set_attn_implementation("eager")
    params = SamplingParams.from_pipeline(eager)
    rollouts = {
        decoding: sample_image_tokens(eager, PROMPTS, HEIGHT, WIDTH, params, seed=0, decoding=decoding)
        for decoding in DECODING_PATHS
    }
    # Eager attention's softmax sums the masked cache in another order than generate()'s shorter one (measured
    # 4.8e-7 on an AVX-512 Zen 4); 1e-5 leaves room for other CPUs' kernels and is still far below what a
    # boolean mask does (tokens differ, log-probs 0.44 apart).
    _assert_same_rollout(rollouts["loop"], rollouts["generate"], atol=1e-5)
    text_config = eager.vision_language_encoder.config.get_text_config(decoder=True)
    text_config._attn_implementation_internal = "flash_attention_2"  # takes no 4-D mask (set as loaded)
    with pytest.raises(ValueError, match="attention 'flash_attention_2'.*sampling.decoding=generate"):
        sample_image_tokens(eager, PROMPTS, HEIGHT, WIDTH, params, seed=0)

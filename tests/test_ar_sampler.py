"""The AR rollout's sampler apart from the learner: folded LoRA, packed grouped-query attention, padded
prompts, the decoding state kept between rollouts, and verl's truncated importance weights over the
mismatch."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.algorithms.grpo.log_probs import teacher_forced_log_probs
from glm_training.algorithms.grpo.rollout_is import mismatch_stats, rollout_is_stats, rollout_is_weights
from glm_training.config import ConfigError, load_config
from glm_training.models.folded_lora import FoldedLoRA
from glm_training.models.lora import add_lora_adapters, tuner_layers
from glm_training.pipeline.ar import pad_prompts, sample_image_tokens
from glm_training.pipeline.ar_logits import SamplingParams
from glm_training.pipeline.ar_sampler import PROMPT_MULTIPLE, FoldedSampler
from glm_training.pipeline.ar_step import DecodeState

PROMPTS = ["a red cat", "a sign that says 'hello there'"]
SIZE = 64
# Float32 on the tiny model: the sampler's and the learner's log-probs differ by float rounding only
# (different kernels and reduction orders: incremental decoding, folded weights, packed attention); measured
# ~5e-7, so 1e-4 leaves room on every CPU, and a stale fold (below) misses it by orders of magnitude.
SAME_DISTRIBUTION = 1e-4


@pytest.fixture
def pipeline(tiny_model_dir) -> GlmImagePipeline:
    return GlmImagePipeline.from_pretrained(tiny_model_dir)


def _with_lora(pipeline, seed: int):
    """The AR model with LoRA on its attention projections, B drawn non-zero (a trained adapter)."""
    module = pipeline.vision_language_encoder
    lora = SimpleNamespace(
        rank=4,
        alpha=8,
        dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        init_weights="gaussian",
    )
    add_lora_adapters(module, lora)
    _draw_b(module, seed)
    return module.eval()


@torch.no_grad()
def _draw_b(module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)


def _gap(module, samples, params) -> tuple[float, float]:
    """(mean, max) |log p_sampler - log p_learner| over the sampled tokens, the learner teacher-forced."""
    with torch.no_grad():
        learner = teacher_forced_log_probs(module, samples, params)
    total, largest = mismatch_stats(learner, samples.sampling_log_probs, samples.completion_mask)
    return float(total) / int(samples.completion_mask.sum()), float(largest)


def test_packed_attention_and_padded_prompts_draw_what_the_loop_draws(pipeline):
    params = SamplingParams.from_pipeline(pipeline)
    assert pipeline.vision_language_encoder.config.text_config.num_key_value_heads == 1  # 2 query heads
    plain = sample_image_tokens(pipeline, PROMPTS, SIZE, SIZE, params, seed=1)
    packed = sample_image_tokens(
        pipeline, PROMPTS, SIZE, SIZE, params, seed=1, packed_attention=True, pad_to_multiple_of=64
    )
    # The generated tokens (the grids and one more); padding only adds masked columns on the left.
    length = int(plain.completion_mask.sum(dim=1)[0]) + 1
    prompt_length = packed.input_ids.shape[1] - length
    assert prompt_length % 64 == 0 and prompt_length > plain.input_ids.shape[1] - length
    assert torch.equal(plain.input_ids[:, -length:], packed.input_ids[:, -length:])
    gap = (plain.sampling_log_probs[:, -length:] - packed.sampling_log_probs[:, -length:]).abs().max()
    assert gap < SAME_DISTRIBUTION
    # The attention implementation is the model's own again afterwards.
    assert pipeline.vision_language_encoder.config.text_config._attn_implementation == "sdpa"


def test_pad_prompts_left_pads_to_the_multiple():
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[0, 1, 1]]), "x": 1}
    padded = pad_prompts(inputs, 4, pad_token_id=0)
    assert padded["input_ids"].tolist() == [[0, 5, 6, 7]] and padded["attention_mask"].tolist() == [
        [0, 0, 1, 1]
    ]
    assert padded["x"] == 1 and pad_prompts(padded, 4, pad_token_id=0) is padded


def test_folded_sampler_samples_the_adapted_policy_and_leaves_it_untouched(pipeline):
    module = _with_lora(pipeline, seed=0)
    params = SamplingParams.from_pipeline(pipeline)
    layers = [name for name, _ in tuner_layers(module)]
    base = {n: p.clone() for n, p in module.named_parameters() if "base_layer" in n}
    sampler = FoldedSampler(module, compile=False)

    samples = sampler.sample(pipeline, PROMPTS, SIZE, SIZE, params, seed=2)
    mean, largest = _gap(module, samples, params)
    assert largest < SAME_DISTRIBUTION, (mean, largest)
    assert [name for name, _ in tuner_layers(module)] == layers  # the LoRA layers are back in place
    assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if n in base)

    # The adapter trains on: the next rollout folds its new weights (`refresh`)...
    _draw_b(module, seed=1)
    samples = sampler.sample(pipeline, PROMPTS, SIZE, SIZE, params, seed=3)
    assert _gap(module, samples, params)[1] < SAME_DISTRIBUTION
    assert len(sampler.state.steps) == 1  # the same shape: its cache and step were kept
    # ...which a stale fold would not sample: the check can fail.
    _draw_b(module, seed=2)
    with sampler.folded.swapped():
        stale = sample_image_tokens(pipeline, PROMPTS, SIZE, SIZE, params, seed=3, pad_to_multiple_of=64)
    assert _gap(module, stale, params)[0] > 100 * SAME_DISTRIBUTION


def test_a_kept_decoding_state_gives_what_a_fresh_one_gives(pipeline):
    params = SamplingParams.from_pipeline(pipeline)
    state = DecodeState()
    first = sample_image_tokens(pipeline, PROMPTS, SIZE, SIZE, params, seed=4, state=state)
    ((cache, _),) = state.steps.values()
    again = sample_image_tokens(pipeline, PROMPTS, SIZE, SIZE, params, seed=5, state=state)
    fresh = sample_image_tokens(pipeline, PROMPTS, SIZE, SIZE, params, seed=5)
    assert next(iter(state.steps.values()))[0] is cache  # reused, emptied, not rebuilt
    assert torch.equal(again.input_ids, fresh.input_ids) and not torch.equal(first.input_ids, fresh.input_ids)
    assert torch.equal(again.sampling_log_probs, fresh.sampling_log_probs)


def test_folding_needs_lora_layers(pipeline):
    with pytest.raises(ValueError, match="sampling.sampler=policy"):
        FoldedLoRA(pipeline.vision_language_encoder)
    assert PROMPT_MULTIPLE == 64


def test_rollout_is_weights_are_verls_truncated_ratios():
    """verl's compute_rollout_importance_weights, token level, truncate mode, written out by hand."""
    learner = torch.tensor([[-1.0, -2.0, 1.0, 30.0, -7.0]])
    sampler = torch.tensor([[-1.1, -1.0, -2.0, 0.0, -1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    weights = rollout_is_weights(learner, sampler, mask, threshold=2.0)
    # log-ratios 0.1, -1, 3 (e^3 > 2: truncated), 30 (clamped to 20 before exp, then truncated); masked: 0
    expected = torch.tensor([[math.exp(0.1), math.exp(-1.0), 2.0, 2.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    stats = rollout_is_stats(weights, mask, 2.0)
    assert stats["rollout_is_ratio_fraction_high"] == 0.5
    assert stats["rollout_is_mean"] == pytest.approx((math.exp(0.1) + math.exp(-1.0) + 4.0) / 4)
    total, largest = mismatch_stats(learner, sampler, mask)
    assert float(total) == pytest.approx(0.1 + 1.0 + 3.0 + 30.0) and float(largest) == 30.0


FOLDED_LORA = ["sampling.sampler=folded", "model.lora.enabled=true"]


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["sampling.sampler=folded"], "model.lora.enabled"),
        (
            ["sampling.sampler=folded", "model.lora.enabled=true", "trainer.strategy=fsdp"],
            "trainer.strategy=ddp",
        ),
        (
            ["sampling.sampler=folded", "model.lora.enabled=true", "sampling.decoding=generate"],
            "decoding=loop",
        ),
        (["algo.rollout_is=true"], "algo.rollout_is_threshold=2.0"),
        (["algo.rollout_is_threshold=0.5"], "must be > 1"),
    ],
)
def test_sampler_and_rollout_is_settings_are_checked_before_loading(overrides, names):
    with pytest.raises(ConfigError, match=re.escape(names)):
        load_config(overrides, "ar_training")

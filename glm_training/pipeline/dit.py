"""GLM-Image's DiT sampling pieces, shared by the decoder algorithms' rollouts, evaluation and the priors.

They follow `diffusers.GlmImagePipeline.__call__` step for step (schedule, `timestep = t - 1`, glyph
embeddings, classifier-free guidance `u + g (c - u)` in float32 with the empty-prompt glyph embeddings and
`prior_token_drop=True` for the unconditional pass), so that a loop built from them reproduces the pipeline's
latents exactly. The AR model's prior tokens (`generate_prior_tokens`) are written once per prompt: every
member of a group shares them, so rewards within a group differ only through the DiT's noise.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


def calculate_shift(image_seq_len: int, base_seq_len: int, base_shift: float, max_shift: float) -> float:
    # GLM-Image's own shift (not the linear interpolation of SD3/Flux): sqrt scaling with the image size.
    return (image_seq_len / base_seq_len) ** 0.5 * max_shift + base_shift


def glm_image_schedule(
    pipeline, num_steps: int, height: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps [N], sigmas [N+1]) float32 on CPU, exactly as `GlmImagePipeline.__call__` computes them."""
    scheduler = pipeline.scheduler
    num_train = scheduler.config.num_train_timesteps
    image_seq_len = ((height // pipeline.vae_scale_factor) * (width // pipeline.vae_scale_factor)) // (
        pipeline.transformer.config.patch_size**2
    )
    timesteps = np.linspace(num_train, 1.0, num_steps + 1)[:-1].astype(np.int64).astype(np.float32)
    mu = calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("base_shift", 0.25),
        scheduler.config.get("max_shift", 0.75),
    )
    # Both are passed, as the pipeline does: the DiT then sees the *unshifted* integer timesteps while the
    # steps use the shifted sigmas. Deriving t from the shifted sigmas would change every prediction.
    scheduler.set_timesteps(timesteps=timesteps, sigmas=timesteps / num_train, mu=mu, device="cpu")
    return scheduler.timesteps.clone().float(), scheduler.sigmas.clone().float()


@dataclass
class GuidanceInputs:
    """What the DiT needs besides latents and time, for one micro-batch of B samples."""

    prompt_embeds: torch.Tensor  # [B, S, D] glyph embeddings (left-padded within the micro-batch)
    negative_embeds: torch.Tensor | None  # [B, S0, D] empty-prompt glyph embeddings; None without CFG
    prior_token_ids: torch.Tensor  # [B, L] upsampled AR image tokens
    target_size: torch.Tensor  # [B, 2] (height, width)
    crop_coords: torch.Tensor  # [B, 2] zeros

    def to(self, device: torch.device) -> GuidanceInputs:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return GuidanceInputs(*(move(getattr(self, f)) for f in self.__dataclass_fields__))  # type: ignore[arg-type]


def _left_pad(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S, D] -> [B, length, D] with zeros on the left, as `GlmImagePipeline._get_glyph_embeds` pads."""
    missing = length - embeds.shape[1]
    if missing <= 0:
        return embeds
    return torch.cat([embeds.new_zeros(embeds.shape[0], missing, embeds.shape[2]), embeds], dim=1)


def predict_velocity_batched_cfg(
    transformer: nn.Module,
    latents: torch.Tensor,
    t: torch.Tensor,
    cond: GuidanceInputs,
    guidance_scale: float,
) -> torch.Tensor:
    """`predict_velocity` with the conditional and unconditional passes in one forward of 2B samples.

    The two halves' glyph embeddings are left-padded with zeros to a common length. GLM-Image's DiT takes
    no text mask, so the padding is attended to: the result differs slightly from two separate passes
    (measured in docs/benchmarks.md), which is why this is an option (`sampling.batched_cfg`).
    """
    if not (guidance_scale > 1 and cond.negative_embeds is not None):
        return predict_velocity(transformer, latents, t, cond, guidance_scale)
    dtype = cond.prompt_embeds.dtype
    batch = latents.shape[0]
    length = max(cond.prompt_embeds.shape[1], cond.negative_embeds.shape[1])
    drop = torch.zeros_like(cond.prior_token_ids, dtype=torch.bool)
    both = transformer(
        hidden_states=torch.cat([latents, latents]).to(dtype),
        encoder_hidden_states=torch.cat(
            [_left_pad(cond.prompt_embeds, length), _left_pad(cond.negative_embeds, length)]
        ),
        prior_token_id=torch.cat([cond.prior_token_ids, cond.prior_token_ids]),
        prior_token_drop=torch.cat([drop, ~drop]),
        timestep=t.to(latents.device).expand(2 * batch) - 1,
        target_size=torch.cat([cond.target_size, cond.target_size]),
        crop_coords=torch.cat([cond.crop_coords, cond.crop_coords]),
        return_dict=False,
    )[0].float()
    velocity, uncond = both[:batch], both[batch:]
    return uncond + guidance_scale * (velocity - uncond)


def predict_velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    t: torch.Tensor,
    cond: GuidanceInputs,
    guidance_scale: float,
) -> torch.Tensor:
    """Guided velocity `u + g (c - u)` in float32, as the pipeline computes it. latents: [B, C, h, w].

    `transformer` may be the DDP/LoRA-wrapped module (training) or the bare one (sampling): both see the
    same inputs, so the recomputed log-probs equal the rollout's.
    """
    dtype = cond.prompt_embeds.dtype
    model_input = latents.to(dtype)
    timestep = t.to(latents.device).expand(latents.shape[0]) - 1
    drop = torch.zeros_like(cond.prior_token_ids, dtype=torch.bool)
    velocity = transformer(
        hidden_states=model_input,
        encoder_hidden_states=cond.prompt_embeds,
        prior_token_id=cond.prior_token_ids,
        prior_token_drop=drop,
        timestep=timestep,
        target_size=cond.target_size,
        crop_coords=cond.crop_coords,
        return_dict=False,
    )[0].float()
    if guidance_scale > 1 and cond.negative_embeds is not None:
        uncond = transformer(
            hidden_states=model_input,
            encoder_hidden_states=cond.negative_embeds,
            prior_token_id=cond.prior_token_ids,
            prior_token_drop=~drop,
            timestep=timestep,
            target_size=cond.target_size,
            crop_coords=cond.crop_coords,
            return_dict=False,
        )[0].float()
        velocity = uncond + guidance_scale * (velocity - uncond)
    return velocity


# `sampling.batched_cfg` -> how the guided velocity is computed.
VELOCITY_FNS: dict[bool, Callable[..., torch.Tensor]] = {
    False: predict_velocity,
    True: predict_velocity_batched_cfg,
}


@torch.no_grad()
def encode_glyphs(pipeline, prompts: Sequence[str], guidance_scale: float, device: torch.device, dtype):
    """Glyph embeddings of the prompts (and of "" for CFG), as `GlmImagePipeline.encode_prompt` makes them.

    Under `no_grad` like the pipeline: the frozen T5 takes other kernels with autograd on (~5e-7 apart).
    """
    prompt_embeds, negative_embeds = pipeline.encode_prompt(
        list(prompts), do_classifier_free_guidance=guidance_scale > 1, device=device, dtype=dtype
    )
    return prompt_embeds, negative_embeds


def build_guidance_inputs(
    pipeline,
    prompts: Sequence[str],
    prior_token_ids: torch.Tensor,
    height: int,
    width: int,
    guidance_scale: float,
    device: torch.device,
    dtype: torch.dtype,
) -> GuidanceInputs:
    prompt_embeds, negative_embeds = encode_glyphs(pipeline, prompts, guidance_scale, device, dtype)
    batch = len(prompts)
    return GuidanceInputs(
        prompt_embeds=prompt_embeds,
        negative_embeds=negative_embeds,
        prior_token_ids=prior_token_ids.to(device),
        target_size=torch.tensor([[height, width]], dtype=dtype, device=device).repeat(batch, 1),
        crop_coords=torch.zeros((batch, 2), dtype=dtype, device=device),
    )


@torch.no_grad()
def decode_latents(pipeline, latents: torch.Tensor) -> list:
    """Latents -> PIL images, with the VAE's latent de-normalisation, as the pipeline's last stage."""
    vae = pipeline.vae
    device = next(vae.parameters()).device
    latents = latents.to(device=device, dtype=vae.dtype)
    channels = vae.config.latent_channels
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1).to(latents.device, latents.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1).to(latents.device, latents.dtype)
    images = vae.decode(latents * std + mean, return_dict=False)[0]
    return pipeline.image_processor.postprocess(images, output_type="pil")


@torch.no_grad()
def generate_prior_tokens(
    pipeline, prompts: Sequence[str], height: int, width: int, seed: int
) -> torch.Tensor:
    """[len(prompts), L] upsampled prior tokens from the frozen AR model (one sample per prompt)."""
    ar = pipeline.vision_language_encoder
    device = next(ar.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    prior, _, _ = pipeline.generate_prior_tokens(
        prompt=list(prompts), height=height, width=width, device=device, generator=generator
    )
    return prior.cpu()


def prompt_seed(seed: int, text: str) -> int:
    """A seed that is a function of a base seed and the prompt text only (not of its batch or rank)."""
    return seed * 1_000_003 + zlib.crc32(text.encode("utf-8"))


def seeded_latents(pipeline, seeds: Sequence[int], height: int, width: int) -> torch.Tensor:
    """[len(seeds), C, h, w] initial DiT latents on the CPU, each drawn from its own seed.

    A sample's noise then depends on its seed only, not on its batch-mates or the batch size.
    """
    shape = (
        pipeline.transformer.config.in_channels,
        height // pipeline.vae_scale_factor,
        width // pipeline.vae_scale_factor,
    )
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


@torch.no_grad()
def render_with_pipeline(
    pipeline,
    prompts: Sequence[str],
    prior_token_ids: torch.Tensor,
    latents: torch.Tensor,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
) -> list:
    """Decode prior tokens [B, L] from initial latents [B, C, h, w] with the pipeline's own ODE sampler.

    Used where the DiT is not what trains (the AR trainer's images, evaluation), so the images are exactly
    what `GlmImagePipeline` produces for these tokens and this noise.
    """
    return pipeline(
        prompt=list(prompts),
        prior_token_ids=prior_token_ids,
        latents=latents,
        height=height,
        width=width,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
    ).images

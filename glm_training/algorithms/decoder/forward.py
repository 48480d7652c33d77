"""The frame of the decoder algorithms that train on the forward process (DiffusionNFT, AWM).

Both sample clean images with the pipeline's own Euler ODE (`ode.py`: NFT with its old model, AWM with the
policy) and keep only the clean latents and the conditioning (`ode_chunk`). Their update (`forward_update`)
noises each clean latent again, `x_t = (1 - t) x_0 + t eps`, at a few times of the sampling schedule with
fresh noise each, one backward per micro-batch and time, averaged over samples and times; noise and times come
from a generator seeded by (seed, step, rank), so a resumed run draws the same ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from glm_training.algorithms.decoder.ode import NFTSamples, keep_for_update, sample_ode
from glm_training.engine.collect import Batch
from glm_training.engine.update import UpdateLoop, UpdateStats

# Offset of the update's noise seed from the rollout's, so the two streams never coincide.
UPDATE_SEED_OFFSET = 1_000_000_007

# (num_samples, generator) -> [num_samples, T] schedule indices at which one micro-batch is noised again.
DrawTimes = Callable[[int, torch.Generator], torch.Tensor]
# (chunk, time_idx [B], noise [B, C, h, w], values [B], rollout, denominator) -> statistics: the loss of one
# micro-batch at one time per sample, and the backward of `sum / denominator`.
LossAndBackward = Callable[..., dict[str, Any]]


@dataclass
class ForwardRollout:
    samples: list[NFTSamples]  # one per micro-batch, in sample order: clean latents and conditioning
    timesteps: torch.Tensor  # [T]: the schedule the update's training times are drawn from
    sigmas: torch.Tensor  # [T + 1]


def forward_rollout(
    decoder, group_prompts, group_ids, step, scoring, sample_chunk
) -> tuple[ForwardRollout, list]:
    """The decoder frame's rollout (`DecoderRollout.sample`) kept as a `ForwardRollout`, with its images."""
    chunks, timesteps, sigmas, images = decoder.sample(group_prompts, group_ids, step, scoring, sample_chunk)
    return ForwardRollout(chunks, timesteps, sigmas), images


def ode_chunk(module, latents, cond, timesteps, sigmas, sampling: Any) -> tuple[NFTSamples, torch.Tensor]:
    """`module`'s ODE sample of one micro-batch; keeps x_0 and the conditioning, and returns x_0 to decode."""
    final = sample_ode(
        module,
        latents,
        cond,
        timesteps,
        sigmas,
        guidance_scale=sampling.guidance_scale,
        batched_cfg=sampling.batched_cfg,
    )
    return keep_for_update(cond, final), final


def forward_update(
    updates: UpdateLoop,
    batch: Batch,
    seed: int,
    per_sample: torch.Tensor,
    stat_names: tuple[str, ...],
    draw_times: DrawTimes,
    loss_and_backward: LossAndBackward,
    device: torch.device,
) -> UpdateStats:
    """`updates.run` over every micro-batch and training time; `per_sample` [N] (the algorithm's weight of
    each sample) reaches the loss sliced to the micro-batch. `seed`: the rollout's (`sample_seed(step)`)."""
    rollout: ForwardRollout = batch.rollout
    chunks = rollout.samples
    sizes = [c.final_latents.shape[0] for c in chunks]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    generator = torch.Generator().manual_seed(seed + UPDATE_SEED_OFFSET)

    def micro_steps(mini: list[int]):
        num_samples = sum(sizes[m] for m in mini)
        for m in mini:
            chunk = chunks[m]
            values = per_sample[offsets[m] : offsets[m] + sizes[m]].to(device)
            # The update's own generator: drawn in the same order however far ahead the loop reads.
            times_bk = draw_times(sizes[m], generator)
            num_times = times_bk.shape[1]
            noise_kb = torch.randn((num_times, *chunk.final_latents.shape), generator=generator)
            for j in range(num_times):
                yield functools.partial(
                    loss_and_backward,
                    chunk,
                    times_bk[:, j],
                    noise_kb[j],
                    values,
                    rollout,
                    num_samples * num_times,
                )

    return updates.run(len(chunks), micro_steps, stat_names)

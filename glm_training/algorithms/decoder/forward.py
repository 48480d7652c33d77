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
from glm_training.engine.update import UpdateLoop, UpdateStats, split_mini_batches

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


def _draw_pass(chunks: list, minis: list[list[int]], draw_times: DrawTimes, generator) -> dict[int, tuple]:
    """Every micro-batch's (times [B, T], noise [T, B, C, h, w], None) for one pass, drawn in the update
    loop's order from the update's own generator (so the same however far ahead the loop reads)."""
    drawn = {}
    for m in [m for mini in minis for m in mini]:
        times_bk = draw_times(chunks[m].final_latents.shape[0], generator)
        noise_kb = torch.randn((times_bk.shape[1], *chunks[m].final_latents.shape), generator=generator)
        drawn[m] = (times_bk, noise_kb, None)
    return drawn


# (chunk, time_idx [B], noise [B, C, h, w], rollout) -> [B] the loss of the weights before the update, for
# the micro-batches of the later optimizer steps (AWM's old loss, `forward_update`'s `old_losses`).
OldLosses = Callable[..., torch.Tensor]


def forward_update(
    updates: UpdateLoop,
    batch: Batch,
    seed: int,
    per_sample: torch.Tensor,
    stat_names: tuple[str, ...],
    draw_times: DrawTimes,
    loss_and_backward: LossAndBackward,
    device: torch.device,
    old_losses: OldLosses | None = None,
) -> UpdateStats:
    """`updates.run` over every micro-batch and training time; `per_sample` [N] (the algorithm's weight of
    each sample) reaches the loss sliced to the micro-batch. `seed`: the rollout's (`sample_seed(step)`).

    Each pass over the rollout draws every micro-batch's times and noise when it starts, in the update
    loop's order, from the update's own generator. With `old_losses`, the micro-batches of the later
    optimizer steps of a pass get the loss of the weights the pass started from, at their own times and
    noise (`loss_and_backward`'s `old_loss`; the first step's micro-batches are on-policy, None), as the AWM
    reference computes its ratio's old loss before the first step."""
    rollout: ForwardRollout = batch.rollout
    chunks = rollout.samples
    sizes = [c.final_latents.shape[0] for c in chunks]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    generator = torch.Generator().manual_seed(seed + UPDATE_SEED_OFFSET)
    minis = split_mini_batches(len(chunks), updates.num_mini_batches)
    current: dict[int, tuple] = {}  # micro-batch -> (times [B, T], noise [T, B, ...], old losses or None)

    def start_pass() -> None:
        current.update(_draw_pass(chunks, minis, draw_times, generator))
        if old_losses is not None:
            for m in [m for mini in minis[1:] for m in mini]:
                times_bk, noise_kb, _ = current[m]
                old = [
                    old_losses(chunks[m], times_bk[:, j], noise_kb[j], rollout) for j in range(len(noise_kb))
                ]
                current[m] = (times_bk, noise_kb, old)

    def micro_steps(mini: list[int]):
        if mini == minis[0]:
            start_pass()
        num_samples = sum(sizes[m] for m in mini)
        for m in mini:
            times_bk, noise_kb, old = current[m]
            values = per_sample[offsets[m] : offsets[m] + sizes[m]].to(device)
            num_times = times_bk.shape[1]
            for j in range(num_times):
                yield functools.partial(
                    loss_and_backward,
                    chunks[m],
                    times_bk[:, j],
                    noise_kb[j],
                    values,
                    rollout,
                    num_samples * num_times,
                    **({} if old is None else {"old_loss": old[j]}),
                )

    return updates.run(len(chunks), micro_steps, stat_names, num_samples=sum(sizes))

"""`ForwardProcessTrainer`: the decoder algorithms that train on the forward process (DiffusionNFT, AWM).

Both sample clean images with the pipeline's own Euler ODE (`rollout/nft.py`: NFT with its old model, AWM
with the policy) and keep only the clean latents and the conditioning. Their update noises each clean latent
again, `x_t = (1 - t) x_0 + t eps`, at a few times of the sampling schedule with fresh noise each, one
backward per micro-batch and time, averaged over samples and times; noise and times come from a generator
seeded by (seed, step, rank), so a resumed run draws the same ones. This class holds that frame; a subclass
supplies:

- `sampler()`: a context giving the module that samples (default: the policy);
- `draw_times(num_samples, generator)`: [B, T] schedule indices for one micro-batch;
- `_loss_and_backward(chunk, time_idx [B], noise [B, C, h, w], values [B], rollout, denominator)`: its
  loss, and the backward of its share of the mean.

`OldPolicy` is the EMA copy of the trained weights both keep (NFT's old model, AWM's anchor).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training import sharding
from glm_training.algorithms.nft import ema_update_
from glm_training.checkpoint import CheckpointError
from glm_training.rollout.nft import NFTSamples, keep_for_update, sample_ode
from glm_training.trainers.diffusion_trainer import DiffusionTrainer
from glm_training.trainers.reward_trainer import Batch, UpdateStats

# Offset of the update's noise seed from the rollout's, so the two streams never coincide.
UPDATE_SEED_OFFSET = 1_000_000_007


@dataclass
class ForwardRollout:
    samples: list[NFTSamples]  # one per micro-batch, in sample order: clean latents and conditioning
    timesteps: torch.Tensor  # [T]: the schedule the update's training times are drawn from
    sigmas: torch.Tensor  # [T + 1]


class OldPolicy:
    """An EMA copy of the trainable weights: DiffusionNFT's old model (it samples and anchors v+ and v-),
    AWM's KL anchor.

    Unsharded, LoRA: the old adapter weights live beside the module and are swapped in (by reference, no
    copy) for the duration of `module()`; full fine-tuning: a frozen copy of the module. Sharded (FSDP): the
    old weights are shards like the parameters' (1/world each, full fine-tuning included), made at first
    use, and `module()` copies them into the parameters' shards and back (every unit resharded first, so no
    gathered copy of the other weights is used); a sharded module's own forward gathers them.
    """

    def __init__(self, module: nn.Module, lora: bool, file: str, sharded: bool = False):
        self.file = file  # its checkpoint file, named in errors
        self.module_ = module
        self.sharded = sharded
        self.copy: nn.Module | None = None
        self._weights: dict[str, torch.Tensor] | None = None
        self._swapped_in = False
        if sharded:
            return  # the module is sharded after this: the shards are copied at first use
        live = self._live()
        if lora:
            self._weights = {n: p.detach().clone() for n, p in live.items()}
        else:
            self.copy = copy.deepcopy(module).requires_grad_(False).eval()
            params = dict(self.copy.named_parameters())
            self._weights = {n: params[n] for n in live}

    def _live(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.module_.named_parameters() if p.requires_grad}

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:  # sharded: the policy's shards at first use (the old model starts equal)
            with torch.no_grad():
                self._weights = {n: p.detach().clone() for n, p in self._live().items()}
        return self._weights

    @contextlib.contextmanager
    def module(self) -> Iterator[nn.Module]:
        """The old model to call (under no_grad): the frozen copy, or the module with the old weights in."""
        if self.copy is not None or self._swapped_in:
            yield self.copy if self.copy is not None else self.module_
            return
        if self.sharded:
            with self._copied_in():
                yield self.module_
            return
        live = self._live()
        current = {n: p.data for n, p in live.items()}
        try:
            for n, p in live.items():
                p.data = self.weights[n].data
            yield self.module_
        finally:
            for n, p in live.items():
                p.data = current[n]

    @contextlib.contextmanager
    def _copied_in(self) -> Iterator[None]:
        sharding.reshard_all(self.module_)
        live = self._live()
        with torch.no_grad():
            stash = {n: p.detach().clone() for n, p in live.items()}
            for n, p in live.items():
                p.copy_(self.weights[n])
        self._swapped_in = True
        try:
            yield
        finally:
            self._swapped_in = False
            sharding.reshard_all(self.module_)
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(stash[n])

    def update(self, decay: float) -> None:
        """`old <- decay * old + (1 - decay) * current` (the reference's update after every rollout)."""
        live = self._live()
        names = list(live)
        ema_update_([self.weights[n] for n in names], [live[n] for n in names], decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on CPU (collective when sharded: the file is the one an unsharded run writes)."""
        return {n: sharding.full_tensor(w.detach()).cpu().clone() for n, w in self.weights.items()}

    def load_from(self, checkpoint: Path, written_by: str) -> None:
        """Load `<checkpoint>/<file>` (the folder rank 0 chose and verified for every rank); a missing file
        names the run that writes one (`written_by`)."""
        file = checkpoint / self.file
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: the checkpoint was not written by {written_by}; resume it with the "
                "config it was trained with."
            )
        self.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.weights):
            raise CheckpointError(
                f"{self.file} does not match the model being trained; was it written with other "
                "model.lora settings?"
            )
        with torch.no_grad():
            for n, w in self.weights.items():
                sharding.copy_full_into_(w, state[n])


class ForwardProcessTrainer(DiffusionTrainer):
    """The ODE rollout of clean latents and the re-noising update loop (see the module docstring)."""

    @contextlib.contextmanager
    def sampler(self) -> Iterator[nn.Module]:
        """The module that samples the rollout: the policy."""
        yield self.trainable

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator) -> tuple[Any, torch.Tensor]:
        """The sampler's ODE sample of one micro-batch; keeps x_0 and the conditioning."""
        s = self.cfg.sampling
        with self.sampler() as module:
            final = sample_ode(
                module,
                latents,
                cond,
                timesteps,
                sigmas,
                guidance_scale=s.guidance_scale,
                batched_cfg=s.batched_cfg,
            )
        return keep_for_update(cond, final), final

    def make_rollout(self, chunks, timesteps, sigmas, step) -> ForwardRollout:
        return ForwardRollout(chunks, timesteps, sigmas)

    @abstractmethod
    def draw_times(self, num_samples: int, generator: torch.Generator) -> torch.Tensor:
        """[num_samples, T] schedule indices at which one micro-batch's clean latents are noised again."""

    @abstractmethod
    def _loss_and_backward(
        self,
        chunk: NFTSamples,
        time_idx: torch.Tensor,
        noise: torch.Tensor,
        values,
        rollout,
        denominator: int,
    ) -> dict[str, Any]:
        """The loss of one micro-batch at one time per sample; backward of `sum / denominator`."""

    def run_forward_update(
        self, batch: Batch, step: int, per_sample: torch.Tensor, stat_names: tuple[str, ...]
    ) -> UpdateStats:
        """`run_update` over every micro-batch and training time; `per_sample` [N] (the algorithm's weight of
        each sample) reaches the loss sliced to the micro-batch."""
        rollout: ForwardRollout = batch.rollout
        chunks = rollout.samples
        sizes = [c.final_latents.shape[0] for c in chunks]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        generator = torch.Generator().manual_seed(self.sample_seed(step) + UPDATE_SEED_OFFSET)

        def micro_steps(mini: list[int]):
            num_samples = sum(sizes[m] for m in mini)
            for m in mini:
                chunk = chunks[m]
                values = per_sample[offsets[m] : offsets[m] + sizes[m]].to(self.device)
                # The update's own generator: drawn in the same order however far ahead the loop reads.
                times_bk = self.draw_times(sizes[m], generator)
                num_times = times_bk.shape[1]
                noise_kb = torch.randn((num_times, *chunk.final_latents.shape), generator=generator)
                for j in range(num_times):
                    yield functools.partial(
                        self._loss_and_backward,
                        chunk,
                        times_bk[:, j],
                        noise_kb[j],
                        values,
                        rollout,
                        num_samples * num_times,
                    )

        return self.run_update(len(chunks), micro_steps, stat_names)

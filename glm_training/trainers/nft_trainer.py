"""`NFTTrainer`: DiffusionNFT (arXiv 2509.16117) on the GLM-Image diffusion decoder.

Follows NVlabs' reference (`scripts/train_nft_sd3.py`) step for step:
- Rollout: the *old* model samples with the pipeline's ODE (`rollout/nft.py`); only the final latents and the
  conditioning are kept. Prior tokens, rewards and advantages are the diffusion base's (`DiffusionTrainer`,
  shared with Flow-GRPO's `DiTTrainer`).
- Update: each sample is noised again at `int(num_steps * timestep_fraction)` distinct times of the sampling
  schedule (drawn per sample, fresh noise each), the current and old velocities are predicted without CFG,
  and the implicit positive/negative policy loss (`algorithms/nft.py`) is averaged over samples and times;
  `num_mini_batches` optimizer steps per rollout. Noise and times come from a generator seeded by
  (seed, step, rank), so a resumed run draws the same ones.
- After the update the old model moves towards the policy: `old <- d old + (1 - d) policy`, d from the
  reference's `decay_type` schedule of the optimizer-step count.

The old model: with LoRA a second copy of the adapter weights, swapped into the module for its forward
passes (the reference keeps a second peft adapter; this costs no extra base weights); with full fine-tuning
a frozen copy of the module. It is saved in every checkpoint (`nft_old_policy.pt`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training import sharding
from glm_training.algorithms.nft import (
    ema_update_,
    nft_loss,
    noised_latents,
    old_model_decay,
    optimality_probability,
    train_time_indices,
    velocity_kl,
)
from glm_training.checkpoint import CheckpointError
from glm_training.rollout.dit import predict_velocity
from glm_training.rollout.nft import NFTSamples, keep_for_update, sample_ode
from glm_training.trainers.diffusion_trainer import DiffusionTrainer
from glm_training.trainers.reward_trainer import Batch

OLD_POLICY_FILE = "nft_old_policy.pt"
NFT_STATS = ("loss", "policy_loss", "kl", "positive_loss", "negative_loss", "old_deviation", "r_mean")
# Offset of the update's noise seed from the rollout's, so the two streams never coincide.
UPDATE_SEED_OFFSET = 1_000_000_007


@dataclass
class NFTRollout:
    samples: list[NFTSamples]  # one per micro-batch, in sample order: clean latents and conditioning
    timesteps: torch.Tensor  # [T]: the schedule the update's training times are drawn from
    sigmas: torch.Tensor  # [T + 1]


class OldPolicy:
    """DiffusionNFT's old model: an EMA of the trainable weights that samples and anchors v+ and v-.

    Unsharded, LoRA: the old adapter weights live beside the module and are swapped in (by reference, no
    copy) for the duration of `module()`; full fine-tuning: a frozen copy of the module. Sharded (FSDP): the
    old weights are shards like the parameters' (1/world each, full fine-tuning included), made at first
    use, and `module()` copies them into the parameters' shards and back (every unit resharded first, so no
    gathered copy of the other weights is used); a sharded module's own forward gathers them.
    """

    def __init__(self, module: nn.Module, lora: bool, file: str = OLD_POLICY_FILE, sharded: bool = False):
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

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.weights):
            raise CheckpointError(
                f"{self.file} does not match the model being trained; was it written with other "
                "model.lora settings?"
            )
        with torch.no_grad():
            for n, w in self.weights.items():
                sharding.copy_full_into_(w, state[n])


class NFTTrainer(DiffusionTrainer):
    """DiffusionNFT: the diffusion rollout frame and advantages, the old model's ODE, the NFT update."""

    def _setup_trainable(self, module: nn.Module) -> nn.Module:
        module = super()._setup_trainable(module)
        # Starts equal to the policy (the reference copies the adapter before the first rollout).
        self.old_policy = OldPolicy(module, self.cfg.model.lora.enabled, sharded=self.parallel.sharded)
        return module

    def sample_chunk(self, latents, cond, timesteps, sigmas, step, generator) -> tuple[Any, torch.Tensor]:
        """The old model's ODE sample of one micro-batch; keeps x_0 and the conditioning."""
        s = self.cfg.sampling
        with self.old_policy.module() as old:
            final = sample_ode(
                old,
                latents,
                cond,
                timesteps,
                sigmas,
                guidance_scale=s.guidance_scale,
                batched_cfg=s.batched_cfg,
            )
        return keep_for_update(cond, final), final

    def make_rollout(self, chunks, timesteps, sigmas, step) -> NFTRollout:
        return NFTRollout(chunks, timesteps, sigmas)

    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        a, s = self.cfg.algo, self.cfg.sampling
        rollout: NFTRollout = batch.rollout
        chunks = rollout.samples
        sizes = [c.final_latents.shape[0] for c in chunks]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        num_times = a.num_train_times(s.num_steps)
        r_n = optimality_probability(batch.advantages.float(), a.adv_clip_max)
        generator = torch.Generator().manual_seed(self.sample_seed(step) + UPDATE_SEED_OFFSET)

        def micro_steps(mini: list[int]):
            num_samples = sum(sizes[m] for m in mini)
            for m in mini:
                chunk = chunks[m]
                r = r_n[offsets[m] : offsets[m] + sizes[m]].to(self.device)
                # The update's own generator: drawn in the same order however far ahead the loop reads.
                times_bk = train_time_indices(sizes[m], s.num_steps, num_times, generator)
                noise_kb = torch.randn((num_times, *chunk.final_latents.shape), generator=generator)
                for j in range(num_times):
                    yield functools.partial(
                        self._loss_and_backward,
                        chunk,
                        times_bk[:, j],
                        noise_kb[j],
                        r,
                        rollout,
                        num_samples * num_times,
                    )

        update = self.run_update(len(chunks), micro_steps, NFT_STATS)
        # The optimizer-step count is the scheduler's, which checkpoints restore: the decay resumes exactly.
        decay = old_model_decay(self.lr_scheduler.last_epoch, a.decay_type)
        self.old_policy.update(decay)
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out["num_optimizer_steps"] = float(update.num_optimizer_steps)
        out["num_train_times"] = float(num_times)
        out["old_decay"] = decay
        return self.mean_over_ranks(out)

    def _loss_and_backward(
        self, chunk: NFTSamples, time_idx: torch.Tensor, noise: torch.Tensor, r, rollout, denominator: int
    ) -> dict[str, float]:
        """NFT loss of one micro-batch at one training time per sample; backward of its share of the mean.

        time_idx [B]: schedule indices (sigma for the forward process, the schedule's timestep for the DiT,
        as in sampling); noise [B, C, h, w]; r [B] optimality probabilities.
        """
        a = self.cfg.algo
        x0 = chunk.final_latents.to(self.device)
        t = rollout.sigmas[time_idx].to(self.device)
        timestep = rollout.timesteps[time_idx].to(self.device)
        x_t = noised_latents(x0, noise.to(self.device), t)
        cond = chunk.cond.to(self.device)
        with self.policy_precision():
            # CFG-free: the conditional velocity only (guidance_scale 1).
            with torch.no_grad(), self.old_policy.module() as old:
                v_old = predict_velocity(old, x_t, timestep, cond, 1.0)
            v = predict_velocity(self.model, x_t, timestep, cond, 1.0)
            policy_b, terms = nft_loss(v, v_old, x_t, x0, t, r, a.nft_beta, a.adv_clip_max)
            kl_b = torch.zeros_like(policy_b)
            if a.beta > 0:
                with torch.no_grad(), self.reference_model() as reference:
                    v_ref = predict_velocity(reference, x_t, timestep, cond, 1.0)
                kl_b = velocity_kl(v, v_ref)
            loss_b = policy_b + a.beta * kl_b
        self.accelerator.backward(loss_b.sum() / denominator)
        return {
            "loss": loss_b.detach().mean(),
            "policy_loss": policy_b.detach().mean(),
            "kl": kl_b.detach().mean(),
            "positive_loss": terms["positive_loss"].mean(),
            "negative_loss": terms["negative_loss"].mean(),
            "old_deviation": ((v.detach() - v_old) ** 2).mean(),
            "r_mean": r.mean(),
        }

    def checkpoint_extras(self) -> dict[str, Any]:
        return {OLD_POLICY_FILE: self.old_policy.state_dict()}

    def load_checkpoint_extras(self, path: Path) -> None:
        # `path` is the checkpoint rank 0 chose and verified (hashes) for every rank.
        file = path / OLD_POLICY_FILE
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: the checkpoint was not written by a DiffusionNFT run "
                "(configs/nft_training.yaml); resume it with the config it was trained with."
            )
        self.old_policy.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

"""`ARTrainer`: GRPO with DAPO's refinements (arXiv 2503.14476) on the GLM-Image autoregressive model.

Rollout: `num_generations` samples of the image tokens per prompt (preview grid, then the large grid) from
the current policy; the frozen DiT renders each sample's large-grid tokens with a noise seed fixed per
group, so reward differences inside a group come from the AR tokens alone.

Update: clipped objective with DAPO's clip-higher (`epsilon_low` / `epsilon_high`) on token-level ratios, or
GSPO's sequence-level ratios (`algo.importance_sampling_level=sequence`, arXiv 2507.18071), the chosen loss
aggregation, optional k3 KL to the reference. Old log-probs are teacher-forced under the weights that
sampled, over the very micro-batches the update uses, and every policy pass (sampling, old log-probs,
update, reference) runs under `policy_precision()`: so the first ratio is exactly 1, under bf16 too; the
log-probs recorded during sampling are kept as a check (`sampling_logp_max_diff`).

Dynamic sampling (DAPO): groups whose rewards are all equal (or, with `algo.min_group_std`, whose reward std
is below that threshold, for continuous rewards) carry no signal and are dropped; every rank
keeps generating and scoring new batches *together* until the global pool holds `num_groups_per_step`
valid groups or `max_resample_rounds` is used up. Each decision is taken from globally gathered data, so
every rank makes the same number of `generate()` calls and collectives (no deadlock), and each rank then
takes an equal slice of the pool, moved to its own device on arrival: a tensor gathered from another rank
never meets this rank's tensors on the device it came from.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from glm_training import distributed as dist
from glm_training.algorithms.advantages import flat_groups
from glm_training.algorithms.gspo import gspo_policy_loss, sequence_ratio_stats
from glm_training.algorithms.losses import (
    clipped_policy_loss,
    k3_kl,
    masked_seq_mean_token_mean,
    masked_seq_mean_token_sum,
    masked_token_mean,
    ratio_stats,
)
from glm_training.data import Prompt
from glm_training.errors import UserError
from glm_training.rewards.combine import ScoringQueue
from glm_training.rollout.ar import (
    ARSamples,
    collate_samples,
    resolve_sampling_params,
    sample_image_tokens,
    split_samples,
    teacher_forced_log_probs,
)
from glm_training.rollout.dit import prompt_seed, render_with_pipeline, seeded_latents
from glm_training.trainers.reward_trainer import Batch, RewardTrainer

logger = logging.getLogger("glm_training")


def _token_level_loss(new_bt, old_bt, adv_b, mask_bt, clip_low: float, clip_high: float, **verl_options):
    return clipped_policy_loss(new_bt, old_bt, adv_b[:, None], clip_low, clip_high, **verl_options)


def _token_level_stats(new_bt, old_bt, mask_bt, clip_low: float, clip_high: float):
    return ratio_stats(new_bt, old_bt, clip_low, clip_high, mask=mask_bt)


# algo.importance_sampling_level -> (per-token loss [B, T], ratio diagnostics), same signatures.
IMPORTANCE_SAMPLING = {
    "token": (_token_level_loss, _token_level_stats),  # GRPO / DAPO
    "sequence": (gspo_policy_loss, sequence_ratio_stats),  # GSPO, arXiv 2507.18071
}

AGGREGATIONS = {
    "token-mean": masked_token_mean,
    "seq-mean-token-mean": masked_seq_mean_token_mean,
    "seq-mean-token-sum": masked_seq_mean_token_sum,
}


class DynamicSamplingExhausted(UserError, RuntimeError):
    """Too few groups with reward spread after the resampling budget (`on_budget_exhausted=error`)."""


@dataclass
class ARRollout:
    records: list[dict]  # one per sample on this rank (see `rollout.ar.split_samples`)


class ARTrainer(RewardTrainer):
    component = "ar"

    def __init__(self, cfg, **reward_kwargs):
        super().__init__(cfg, **reward_kwargs)  # reward_funcs / reward_weights (Python API)
        s = cfg.sampling
        pipe = self.wrapper.pipeline
        pipe.set_progress_bar_config(disable=True)
        self.sampling_params, described = resolve_sampling_params(pipe, s.temperature, s.top_p, s.top_k)
        logger.info(described)
        self.pad_token_id = pipe.processor.tokenizer.pad_token_id

    def flat_groups(self, rewards_gk: torch.Tensor) -> torch.Tensor:
        return flat_groups(rewards_gk, self.cfg.algo.min_group_std)

    # ---------------------------------------------------------------------------------------------------
    # Rollout

    def _rollout(
        self,
        group_prompts: list[Prompt],
        group_ids: list[int],
        step: int,
        scoring: ScoringQueue,
        round_index: int = 0,
    ) -> tuple[ARRollout, list]:
        s = self.cfg.sampling
        texts = [group_prompts[g].text for g in group_ids]
        with self.policy_precision(), self.parallel.sampling(self.trainable):
            samples = sample_image_tokens(
                self.wrapper.pipeline,
                texts,
                s.height,
                s.width,
                self.sampling_params,
                seed=self.sample_seed(step, round_index),
                decoding=s.decoding,
                static_cache=s.static_cache,
                compile=s.compile,
            )
        seeds = self._noise_seeds(texts, group_ids, step, round_index)
        prompts = [group_prompts[g] for g in group_ids]
        images = self._render(samples.prior_token_ids, prompts, seeds, scoring)
        return ARRollout(split_samples(samples)), images

    def _noise_seeds(self, texts: list[str], group_ids: list[int], step: int, round_index: int) -> list[int]:
        """One DiT noise seed per sample, shared by its group (see `sampling.dit_noise_seed`)."""
        seed = self.cfg.trainer.seed
        if self.cfg.sampling.dit_noise_seed == "prompt":
            return [prompt_seed(seed, text) for text in texts]
        base = ((seed * 1_000_003 + step) * 101 + round_index) * 7919
        return [base + g for g in group_ids]

    @torch.no_grad()
    def _render(self, prior: torch.Tensor, prompts: list[Prompt], seeds: list[int], scoring: ScoringQueue):
        """Decode each sample's tokens with the frozen DiT from its noise seed; score chunk by chunk."""
        s = self.cfg.sampling
        pipe = self.wrapper.pipeline
        latents = seeded_latents(pipe, seeds, s.height, s.width)
        images = []
        chunk = self.cfg.algo.micro_batch_size
        for start in range(0, len(prompts), chunk):
            chunk_prompts = prompts[start : start + chunk]
            chunk_images = render_with_pipeline(
                pipe,
                [p.text for p in chunk_prompts],
                prior[start : start + chunk].to(self.device),
                latents[start : start + chunk].to(self.device),
                s.height,
                s.width,
                s.dit_num_steps,
                s.dit_guidance_scale,
            )
            self.submit_chunk(scoring, chunk_images, chunk_prompts)
            images += chunk_images
        return images

    # ---------------------------------------------------------------------------------------------------
    # Dynamic sampling

    def _collect(self, step: int) -> Batch:
        if not self.cfg.algo.dynamic_sampling:
            return super()._collect(step)
        a, k = self.cfg.algo, self.cfg.data.num_generations
        target = self.cfg.data.num_groups_per_step
        pool: list[list[dict]] = []  # valid groups, identical on every rank
        self.last_sampling_decisions: list[dict] = []  # every generated group and whether it was kept
        generated_rewards, generated_parts, num_groups_seen, rounds = [], [], 0, 0
        preview = None
        while True:
            group_prompts, group_ids = self._step_samples(step, round_index=rounds)
            scoring = self.rewards.queue(overlap=self.cfg.reward.overlap)
            rollout, images = self._rollout(group_prompts, group_ids, step, scoring, rounds)
            parts = scoring.result()
            for record, prompt_index, i in zip(rollout.records, group_ids, range(len(group_ids))):
                record["prompt"] = group_prompts[prompt_index]
                record["parts"] = {name: values[i].reshape(()) for name, values in parts.items()}
            # Everyone sees every sample. Records are CPU tensors wherever they are (`split_samples`; the
            # update collates them with CPU padding and moves each micro-batch to the device itself), so
            # they arrive on the CPU: all on one device, never another rank's (seed 003), and not this
            # rank's GPU either, where the collation's CPU padding would meet them.
            everyone = dist.flatten(dist.gather_objects(rollout.records, device="cpu"))
            # Whole groups are gathered, so the totals combine every reward over complete groups.
            totals = self.rewards.combine(
                {n: torch.stack([r["parts"][n] for r in everyone]).float().cpu() for n in parts}, k
            )
            for record, total in zip(everyone, totals):
                record["reward"] = total.reshape(())
            if preview is None:
                start, _ = dist.shard_bounds(len(everyone), self.rank, self.world_size)
                mine = totals[start : start + len(images)].tolist()
                preview = (images, [group_prompts[g].text for g in group_ids], mine)
            groups = [everyone[g * k : (g + 1) * k] for g in range(len(everyone) // k)]
            rewards_gk = totals.view(-1, k)
            flat = self.flat_groups(rewards_gk)
            pool += [grp for grp, is_flat in zip(groups, flat.tolist()) if not is_flat]
            self.last_sampling_decisions += [
                {
                    "round": rounds,
                    "prompt": grp[0]["prompt"].text,
                    "rewards": rewards_gk[i].tolist(),
                    "kept": not f,
                }
                for i, (grp, f) in enumerate(zip(groups, flat.tolist()))
            ]
            generated_rewards.append(rewards_gk.reshape(-1))
            generated_parts.append(
                {n: torch.stack([r["parts"][n] for r in everyone]).float().cpu() for n in parts}
            )
            num_groups_seen += len(groups)
            rounds += 1
            if len(pool) >= target or rounds > a.max_resample_rounds:
                break
        num_valid = len(pool)
        if num_valid < target:
            pool = self._budget_exhausted(pool, num_valid, target, rounds)
        pool = pool[:target]
        all_rewards = torch.cat(generated_rewards)
        stats = {
            "reward_mean": all_rewards.mean().item(),
            "reward_std": all_rewards.std(unbiased=False).item(),
            "frac_zero_std_groups": 1.0 - num_valid / num_groups_seen,
            "resample_rounds": rounds,
            "valid_groups": num_valid,
            "trained_groups": len(pool),
        }
        for name in generated_parts[0]:
            stats[f"reward/{name}"] = torch.cat([p[name] for p in generated_parts]).mean().item()
        if not pool:
            return Batch([], [], torch.zeros(0), {}, torch.zeros(0), ARRollout([]), stats, preview)
        pool_records = dist.flatten(pool)
        pool_rewards = torch.stack([r["reward"] for r in pool_records]).float().cpu()
        advantages, _ = self.global_advantages(pool_rewards, {})
        start, end = dist.shard_bounds(len(pool_records), self.rank, self.world_size)
        mine = pool_records[start:end]
        return Batch(
            [r["prompt"] for r in mine],
            [],
            pool_rewards[start:end],
            {},
            advantages[start:end],
            ARRollout(mine),
            stats,
            preview,
        )

    def _budget_exhausted(self, pool: list, num_valid: int, target: int, rounds: int) -> list:
        min_std = self.cfg.algo.min_group_std
        spread = f"reward std >= algo.min_group_std={min_std}" if min_std > 0 else "non-zero reward spread"
        message = (
            f"dynamic sampling found {num_valid} of {target} groups with {spread} after {rounds} round(s)"
        )
        if self.cfg.algo.on_budget_exhausted == "error":
            raise DynamicSamplingExhausted(
                f"{message}. Raise algo.max_resample_rounds, use a reward with more spread (or a lower "
                "algo.min_group_std), or set "
                "algo.on_budget_exhausted=warn to train on what was found."
            )
        # Train on what was found, in a size every rank can share equally.
        k, w = self.cfg.data.num_generations, self.world_size
        usable = num_valid
        while usable and (usable * k) % w:
            usable -= 1
        logger.warning("%s; training on %d group(s) this step.", message, usable)
        return pool[:usable]

    # ---------------------------------------------------------------------------------------------------
    # Update

    def _micro_batches(self, records: list[dict]) -> list[ARSamples]:
        size = self.cfg.algo.micro_batch_size
        return [
            collate_samples(records[i : i + size], self.pad_token_id) for i in range(0, len(records), size)
        ]

    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        records = batch.rollout.records
        if not records:
            logger.warning("step %d: no group with reward spread; no update.", step + 1)
            return self.mean_over_ranks({"loss": 0.0, "skipped": 1.0})
        micro = self._micro_batches(records)
        offsets = [0]
        for mb in micro:
            offsets.append(offsets[-1] + mb.input_ids.shape[0])
        params = self.sampling_params
        with torch.no_grad(), self.policy_precision():
            # Same weights, same micro-batches, same precision as the first inner step below: its ratio is
            # exactly 1 (and with full fine-tuning the frozen reference's KL is exactly 0).
            old = [teacher_forced_log_probs(self.model, mb, params) for mb in micro]
            ref = None
            if a.beta > 0:
                with self.reference_model() as reference:
                    ref = [teacher_forced_log_probs(reference, mb, params) for mb in micro]
        diff = max(
            (o.cpu() - mb.sampling_log_probs).abs()[mb.completion_mask].max().item()
            for o, mb in zip(old, micro)
        )

        def micro_steps(mini: list[int]):
            weights = self._aggregation_weights([micro[m] for m in mini])
            for pos, m in enumerate(mini):
                adv = batch.advantages[offsets[m] : offsets[m + 1]].to(self.device)
                reference = ref[m] if ref is not None else None
                yield functools.partial(
                    self._loss_and_backward, micro[m], old[m], reference, adv, weights[pos]
                )

        update = self.run_update(len(micro), micro_steps)
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out["sampling_logp_max_diff"] = diff
        out["num_samples"] = float(len(records))
        return self.mean_over_ranks(out)

    def _loss_and_backward(
        self, mb: ARSamples, old: torch.Tensor, ref: torch.Tensor | None, adv: torch.Tensor, weight: float
    ) -> dict[str, Any]:
        """Token-level (or GSPO sequence-level) clipped loss of one micro-batch; backward of `weight` x it.

        `weight` is the micro-batch's share of its mini-batch's aggregate (`_aggregation_weights`).
        """
        a = self.cfg.algo
        aggregate = AGGREGATIONS[a.loss_aggregation]
        policy_loss_fn, ratio_stats_fn = IMPORTANCE_SAMPLING[a.importance_sampling_level]
        mask = mb.completion_mask.to(self.device)
        with self.policy_precision():
            new = teacher_forced_log_probs(self.model, mb, self.sampling_params)
            # verl's dual clip and log-ratio clamp apply to token ratios (config refuses them with GSPO).
            verl_options = (
                {"clip_ratio_c": a.clip_ratio_c, "log_ratio_clamp": a.log_ratio_clamp}
                if a.importance_sampling_level == "token"
                else {}
            )
            per_token = policy_loss_fn(new, old, adv, mask, a.epsilon_low, a.epsilon_high, **verl_options)
            policy_loss = aggregate(per_token, mask)
            kl = (
                aggregate(k3_kl(new, ref, low_var_clamp=a.kl_low_var_clamp), mask)
                if ref is not None
                else torch.zeros(())
            )
            loss = policy_loss + a.beta * kl
            self.accelerator.backward(loss * weight)
        diag = ratio_stats_fn(new.detach(), old, mask, a.epsilon_low, a.epsilon_high)
        return {"loss": loss, "policy_loss": policy_loss, "kl": kl, **diag}

    def _aggregation_weights(self, micro: list[ARSamples]) -> list[float]:
        """Per-micro-batch weights: the summed micro-batch losses equal the mini-batch's aggregate."""
        if self.cfg.algo.loss_aggregation == "token-mean":
            sizes = [float(mb.completion_mask.sum()) for mb in micro]
        else:
            sizes = [float(mb.input_ids.shape[0]) for mb in micro]
        total = sum(sizes)
        return [size / total for size in sizes]

"""`GRPO`: GRPO with DAPO's refinements (arXiv 2503.14476) on the GLM-Image autoregressive model.

Rollout: `num_generations` samples of the image tokens per prompt (preview grid, then the large grid) from
the current policy; the frozen DiT renders each sample's large-grid tokens with a noise seed fixed per
group, so reward differences inside a group come from the AR tokens alone.

Update: clipped objective with DAPO's clip-higher (`epsilon_low` / `epsilon_high`) on token-level ratios, or
GSPO's sequence-level ratios (`algo.importance_sampling_level=sequence`, arXiv 2507.18071), the chosen loss
aggregation, optional k3 KL to the reference. Old log-probs are teacher-forced under the weights that
sampled, over the very micro-batches the update uses, and every policy pass (sampling, old log-probs,
update, reference) runs under `Policy.precision()`: so the first ratio is exactly 1, under bf16 too; the
log-probs recorded during sampling are compared with them (`sampling_logp_mean_diff`,
`sampling_logp_max_diff`) and, with `algo.rollout_is_threshold`, weight the loss by verl's truncated
importance sampling (`rollout_is.py`). `sampling.sampler` picks who samples: the policy module, or the folded
sampler (`pipeline/ar_sampler.py`).

Dynamic sampling (DAPO's, `algo.dynamic_sampling`) is `dynamic_sampling.py`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from glm_training.algorithms.base import Algorithm
from glm_training.algorithms.grpo.dynamic_sampling import DynamicSampling
from glm_training.algorithms.grpo.gspo import gspo_policy_loss, sequence_ratio_stats
from glm_training.algorithms.grpo.log_probs import (
    ARRollout,
    collate_samples,
    split_samples,
    teacher_forced_log_probs,
)
from glm_training.algorithms.grpo.rollout_is import mismatch_stats, rollout_is_stats, rollout_is_weights
from glm_training.algorithms.losses import (
    clipped_policy_loss,
    k3_kl,
    masked_seq_mean_token_mean,
    masked_seq_mean_token_sum,
    masked_token_mean,
    ratio_stats,
)
from glm_training.data import Prompt
from glm_training.engine.advantages import GroupAdvantages
from glm_training.engine.collect import Batch
from glm_training.engine.parts import Parts
from glm_training.pipeline.ar import ARSamples, sample_image_tokens
from glm_training.pipeline.ar_logits import resolve_sampling_params
from glm_training.pipeline.ar_sampler import FoldedSampler
from glm_training.pipeline.dit import prompt_seed, render_with_pipeline, seeded_latents
from glm_training.rewards.combine import ScoringQueue

logger = logging.getLogger("glm_training")


def _token_level_loss(new_bt, old_bt, adv_b, mask_bt, clip_low: float, clip_high: float, **verl_options):
    return clipped_policy_loss(new_bt, old_bt, adv_b[:, None], clip_low, clip_high, **verl_options)


def _token_level_stats(new_bt, old_bt, mask_bt, clip_low: float, clip_high: float, adv_b=None):
    advantages = None if adv_b is None else adv_b[:, None]
    return ratio_stats(new_bt, old_bt, clip_low, clip_high, mask=mask_bt, advantages=advantages)


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


class GRPO(Algorithm):
    """GRPO / DAPO / GSPO on the AR model: token samples rendered by the frozen DiT; the clipped objective."""

    def __init__(self, cfg: Any, parts: Parts):
        super().__init__(cfg, parts)
        a = cfg.algo
        self.advantages = GroupAdvantages(
            cfg.data.num_generations, a.scale_rewards, a.adv_clip_max, min_group_std=a.min_group_std
        )
        pipe = self.policy.wrapper.pipeline
        pipe.set_progress_bar_config(disable=True)
        s = cfg.sampling
        self.sampling_params, described = resolve_sampling_params(pipe, s.temperature, s.top_p, s.top_k)
        logger.info(described)
        self.pad_token_id = pipe.processor.tokenizer.pad_token_id
        self.sampler = FoldedSampler(self.policy.trainable, s.compile) if s.sampler == "folded" else None
        self.dynamic = (
            DynamicSampling(cfg, self.collector, self.rollout, self.advantages)
            if a.dynamic_sampling
            else None
        )

    def collect(self, step: int) -> Batch:
        return self.dynamic.collect(step) if self.dynamic is not None else super().collect(step)

    @property
    def last_sampling_decisions(self) -> list[dict]:
        """Every group dynamic sampling generated at the latest step, and whether it was kept."""
        return self.dynamic.decisions

    # ---------------------------------------------------------------------------------------------------
    # Rollout

    def rollout(
        self,
        group_prompts: list[Prompt],
        group_ids: list[int],
        step: int,
        scoring: ScoringQueue,
        round_index: int = 0,
    ) -> tuple[ARRollout, list]:
        samples = self.sample_tokens(group_prompts, group_ids, step, round_index)
        texts = [group_prompts[g].text for g in group_ids]
        seeds = self.noise_seeds(texts, group_ids, step, round_index)
        prompts = [group_prompts[g] for g in group_ids]
        images = self._render(samples.prior_token_ids, prompts, seeds, scoring)
        return ARRollout(split_samples(samples)), images

    def sample_tokens(
        self, group_prompts: list[Prompt], group_ids: list[int], step: int, round_index: int = 0
    ) -> ARSamples:
        """This rank's image tokens from the policy, with the log-probs of sampling (the rollout's first
        half: `train_joint.py` renders them with the DiT it trains)."""
        s, policy = self.cfg.sampling, self.policy
        texts = [group_prompts[g].text for g in group_ids]
        seed = self.collector.sample_seed(step, round_index)
        if self.sampler is not None:
            with policy.precision():
                pipe = policy.wrapper.pipeline
                return self.sampler.sample(pipe, texts, s.height, s.width, self.sampling_params, seed)
        with policy.precision(), policy.parallel.sampling(policy.trainable):
            return sample_image_tokens(
                policy.wrapper.pipeline,
                texts,
                s.height,
                s.width,
                self.sampling_params,
                seed=seed,
                decoding=s.decoding,
                static_cache=s.static_cache,
                compile=s.compile,
            )

    def noise_seeds(self, texts: list[str], group_ids: list[int], step: int, round_index: int) -> list[int]:
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
        pipe = self.policy.wrapper.pipeline
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
            self.collector.submit_chunk(scoring, chunk_images, chunk_prompts)
            images += chunk_images
        return images

    # ---------------------------------------------------------------------------------------------------
    # Update

    def _micro_batches(self, records: list[dict]) -> list[ARSamples]:
        size = self.cfg.algo.micro_batch_size
        return [
            collate_samples(records[i : i + size], self.pad_token_id) for i in range(0, len(records), size)
        ]

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        a = self.cfg.algo
        records = batch.rollout.records
        if not records:
            logger.warning("step %d: no group with reward spread; no update.", step + 1)
            return self.collector.mean_over_ranks({"loss": 0.0, "skipped": 1.0})
        micro = self._micro_batches(records)
        offsets = [0]
        for mb in micro:
            offsets.append(offsets[-1] + mb.input_ids.shape[0])
        params = self.sampling_params
        with torch.no_grad(), self.policy.precision():
            # Same weights, same micro-batches, same precision as the first inner step below: its ratio is
            # exactly 1 (and with full fine-tuning the frozen reference's KL is exactly 0).
            old = [teacher_forced_log_probs(self.policy.model, mb, params) for mb in micro]
            ref = None
            if a.beta > 0:
                with self.policy.reference_model() as reference:
                    ref = [teacher_forced_log_probs(reference, mb, params) for mb in micro]
        mismatch, is_weights = self._sampler_mismatch(old, micro)

        def micro_steps(mini: list[int]):
            weights = self._aggregation_weights([micro[m] for m in mini])
            for pos, m in enumerate(mini):
                adv = batch.advantages[offsets[m] : offsets[m + 1]].to(self.device)
                reference = ref[m] if ref is not None else None
                tis = is_weights[m] if a.rollout_is else None
                yield functools.partial(
                    self.loss_and_backward, micro[m], old[m], reference, adv, weights[pos], tis
                )

        update = self.updates.run(len(micro), micro_steps, num_samples=len(records))
        out = dict(update.means)
        out["grad_norm"] = update.grad_norm
        out.update(mismatch)
        out["num_samples"] = float(len(records))
        return self.collector.mean_over_ranks(out)

    def _sampler_mismatch(
        self, old: list[torch.Tensor], micro: list[ARSamples]
    ) -> tuple[dict[str, float], list[torch.Tensor | None]]:
        """The sampler's log-probs against the learner's old ones (`rollout_is.py`): the mean and max gap
        over the sampled tokens, and each micro-batch's truncated importance weights (None unless
        `algo.rollout_is_threshold` is set), with verl's statistics of them."""
        threshold = self.cfg.algo.rollout_is_threshold
        total, count, largest, weights = 0.0, 0, 0.0, []
        for o, mb in zip(old, micro):
            sampler, mask = mb.sampling_log_probs.to(o.device), mb.completion_mask.to(o.device)
            gap_sum, gap_max = mismatch_stats(o, sampler, mask)
            total, count = total + float(gap_sum), count + int(mask.sum())
            largest = max(largest, float(gap_max))
            weights.append(None if threshold is None else rollout_is_weights(o, sampler, mask, threshold))
        stats = {"sampling_logp_mean_diff": total / max(count, 1), "sampling_logp_max_diff": largest}
        if threshold is not None:
            masks = torch.cat([mb.completion_mask.reshape(-1) for mb in micro])
            flat = torch.cat([w.reshape(-1).cpu() for w in weights])
            stats.update(rollout_is_stats(flat, masks, threshold))
        return stats, weights

    def loss_and_backward(
        self,
        mb: ARSamples,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        adv: torch.Tensor,
        weight: float,
        is_weights: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Token-level (or GSPO sequence-level) clipped loss of one micro-batch; backward of `weight` x it.

        `weight` is the micro-batch's share of its mini-batch's aggregate (`_aggregation_weights`);
        `is_weights` [B, T]: verl's truncated importance weights, multiplying the per-token loss after the
        clips (`algo.rollout_is`).
        """
        a = self.cfg.algo
        aggregate = AGGREGATIONS[a.loss_aggregation]
        policy_loss_fn, ratio_stats_fn = IMPORTANCE_SAMPLING[a.importance_sampling_level]
        mask = mb.completion_mask.to(self.device)
        with self.policy.precision():
            new = teacher_forced_log_probs(self.policy.model, mb, self.sampling_params)
            # verl's dual clip and log-ratio clamp apply to token ratios (config refuses them with GSPO).
            verl_options = (
                {"clip_ratio_c": a.clip_ratio_c, "log_ratio_clamp": a.log_ratio_clamp}
                if a.importance_sampling_level == "token"
                else {}
            )
            per_token = policy_loss_fn(new, old, adv, mask, a.epsilon_low, a.epsilon_high, **verl_options)
            if is_weights is not None:
                per_token = per_token * is_weights
            policy_loss = aggregate(per_token, mask)
            kl = (
                aggregate(k3_kl(new, ref, low_var_clamp=a.kl_low_var_clamp), mask)
                if ref is not None
                else torch.zeros(())
            )
            loss = policy_loss + a.beta * kl
            self.policy.backward(loss * weight)
        # clip_frac as verl and TRL count it: the clips that change the loss.
        diag = ratio_stats_fn(new.detach(), old, mask, a.epsilon_low, a.epsilon_high, adv)
        return {"loss": loss, "policy_loss": policy_loss, "kl": kl, **diag}

    def _aggregation_weights(self, micro: list[ARSamples]) -> list[float]:
        """Per-micro-batch weights: the summed micro-batch losses equal the mini-batch's aggregate."""
        if self.cfg.algo.loss_aggregation == "token-mean":
            sizes = [float(mb.completion_mask.sum()) for mb in micro]
        else:
            sizes = [float(mb.input_ids.shape[0]) for mb in micro]
        total = sum(sizes)
        return [size / total for size in sizes]

"""Held-out evaluation: deterministic sampling on fixed prompts, every configured reward, an image grid.

Sampling is the pipeline's own deterministic path: the AR model writes each prompt's prior tokens from a
generator seeded by (eval.seed, prompt text), and the DiT decodes them with `GlmImagePipeline`'s ODE sampler
(no SDE noise) from initial latents drawn from the same seed. A prompt's image therefore depends only on the
weights, the prompt and the seed, not on which rank or batch it lands in, so two evaluations of the same
weights give the same numbers. Each reward is reported as a mean and per prompt; the total is the weighted sum
of the raw scores (with one image per prompt there is no group to normalise within).

Two guards against reward hacking, both off by default (the default result is unchanged):

- watched rewards (`eval.watch_rewards`): scored on the same images and reported beside the training rewards
  (`watched`, scalars `eval/watched/<name>`), never in `reward_mean`. A policy that games its reward (JPEG
  noise for compressibility, text-shaped blobs for OCR) shows up as a watched reward falling while the
  trained one climbs.
- text metrics (`eval.text_metrics`), as GLM-Image reports text rendering: for each prompt that carries text
  (`target_text`: its JSONL `text`, else its quoted text), the text RapidOCR reads in the image is compared
  with it by word accuracy and normalised edit distance (`rewards/ocr.py`, `word_accuracy` and
  `normalized_edit_distance`); the overall numbers are means over those prompts, and prompts without text are
  left out and counted (an evaluation set without any is a `ConfigError` at start-up).

With `image_stats` (the trainer's `eval.image_stats`, on by default) each image's statistics
(`image_stats.py`) are summarised as `image_stats` and scalars `eval/image/<name>`.

During training (`eval.every_n_steps`) the trainer calls `evaluate_prompts` on its live (or EMA) weights;
standalone, `python -m glm_training.evaluate` (`evaluate.py`) on the weights `evaluated_weights` names.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from glm_training.config import ConfigError
from glm_training.data import Prompt, PromptFileError, load_prompts
from glm_training.distributed import collectives as dist
from glm_training.image_grid import caption, make_image_grid
from glm_training.image_stats import image_record, summarise
from glm_training.models.halves import model_half
from glm_training.pipeline.dit import generate_prior_tokens, prompt_seed, render_with_pipeline, seeded_latents
from glm_training.rewards.combine import RewardSet, weighted_sum
from glm_training.rewards.ocr import (
    MISSING_TEXT_FIX,
    OcrReward,
    normalized_edit_distance,
    target_text,
    word_accuracy,
)

logger = logging.getLogger("glm_training")


@dataclass(frozen=True)
class EvalSampling:
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    batch_size: int


def eval_sampling(cfg: Any) -> EvalSampling:
    """The evaluation's sampling settings: `cfg.eval`, with zeros/nulls taken from the training sampling."""
    e, s = cfg.eval, cfg.sampling
    steps, guidance = model_half(cfg.component).render_settings(s)
    return EvalSampling(
        height=e.height or s.height,
        width=e.width or s.width,
        num_inference_steps=e.num_inference_steps or steps,
        guidance_scale=guidance if e.guidance_scale is None else e.guidance_scale,
        seed=e.seed,
        batch_size=e.batch_size,
    )


def load_eval_prompts(eval_cfg: Any) -> list[Prompt]:
    """The held-out prompts (`eval.prompt_file`, first `eval.num_prompts`); errors name the `eval.` key."""
    path = eval_cfg.resolved_prompt_file()
    try:
        prompts = load_prompts(path)
    except PromptFileError as err:
        raise PromptFileError(
            f"eval.prompt_file: {err}".replace("data.prompt_file", "eval.prompt_file")
        ) from None
    return prompts[: eval_cfg.num_prompts] if eval_cfg.num_prompts else prompts


def watched_reward_set(cfg: Any) -> RewardSet | None:
    """`eval.watch_rewards` as a `RewardSet` built with `eval.watch_reward_options` (weights unused), or None.

    A watched reward that also trains (`reward.names`) watches nothing: a `ConfigError` before any is built.
    """
    names = cfg.eval.watch_rewards
    if not names:
        return None
    training = sorted(set(names) & set(cfg.reward.names))
    if training:
        raise ConfigError(
            "eval.watch_rewards",
            f"{training} also in reward.names, so training optimises them; a watched reward is one "
            "training never sees. Remove them from eval.watch_rewards (training rewards are reported "
            "under `rewards`).",
        )
    return RewardSet({name: 1.0 for name in names}, dict(cfg.eval.watch_reward_options))


def check_eval_prompts(
    prompts: list[Prompt], reward_sets: list[RewardSet | None], text_metrics: bool
) -> None:
    """Every reward's prompt check on the held-out prompts and, with `text_metrics`, that one carries text.

    Runs at start-up, before any model loads. Prompts without text are left out of the text metrics (logged
    with their count); an evaluation set where none has text is a `ConfigError`.
    """
    texts, metadata = [p.text for p in prompts], [p.metadata for p in prompts]
    for reward_set in reward_sets:
        if reward_set is not None:
            reward_set.check_prompts(texts, metadata)
    if not text_metrics:
        return
    num_without = sum(not target_text(t, m) for t, m in zip(texts, metadata))
    if num_without == len(prompts):
        raise ConfigError(
            "eval.text_metrics",
            f"none of the {len(prompts)} held-out prompts (eval.prompt_file) carries text to read: "
            f"{MISSING_TEXT_FIX} (e.g. eval.prompt_file=glm_training/data/ocr_eval.jsonl), or set "
            "eval.text_metrics=false.",
        )
    if num_without:
        logger.warning(
            "eval.text_metrics: %d of %d held-out prompts carry no text; the text metrics leave them out",
            num_without,
            len(prompts),
        )


def text_recogniser(reward_sets: list[RewardSet | None]) -> OcrReward:
    """The recogniser of the text metrics: the `ocr` reward of a training or watched set (with its options),
    else one with the OCR reward's defaults."""
    rewards = [r for reward_set in reward_sets if reward_set is not None for r in reward_set.rewards.values()]
    return next((r for r in rewards if isinstance(r, OcrReward)), None) or OcrReward()


def text_scores(recogniser: OcrReward, image, prompt: Prompt) -> dict[str, Any] | None:
    """One prompt's text metrics (target, recognised text, word accuracy, NED); None when it has no text."""
    target = target_text(prompt.text, prompt.metadata)
    if not target:
        return None
    recognised = recogniser.recognise(image)
    return {
        "target": target,
        "recognised": recognised,
        "word_accuracy": word_accuracy(recognised, target),
        "normalized_edit_distance": normalized_edit_distance(recognised, target),
    }


def summarise_text_metrics(per_prompt: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The `text_metrics` section: means over the prompts with text (None when none has), and per prompt."""
    scored = [r for r in per_prompt if r is not None]

    def mean(key: str) -> float | None:
        return sum(r[key] for r in scored) / len(scored) if scored else None

    return {
        "num_with_text": len(scored),
        "num_without_text": len(per_prompt) - len(scored),
        "word_accuracy": mean("word_accuracy"),
        "normalized_edit_distance": mean("normalized_edit_distance"),
        "per_prompt": per_prompt,
    }


def rank_batches(num_prompts: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's prompt batches: fixed global batches of `batch_size`, dealt round-robin to the ranks."""
    batches = [list(range(i, min(i + batch_size, num_prompts))) for i in range(0, num_prompts, batch_size)]
    return batches[rank::world_size]


def _rank_work(
    num_prompts: int, batch_size: int, rank: int, world_size: int, equal_calls: bool
) -> list[tuple[list[int], int]]:
    """This rank's batches as (prompt indices, how many of them are scored, from the front).

    With `equal_calls`, every rank gets as many batches as rank 0, each as long as rank 0's first: a short
    batch is filled, and a missing one made, with the first prompts, sampled and thrown away. The AR model
    makes one `generate()` per prompt and the DiT one pipeline call per batch, so both then make the same
    calls on every rank.
    """
    work = [(batch, len(batch)) for batch in rank_batches(num_prompts, batch_size, rank, world_size)]
    if not equal_calls:
        return work
    length = min(batch_size, num_prompts)
    most = len(rank_batches(num_prompts, batch_size, 0, world_size))
    filled = [(batch + list(range(length - len(batch))), n) for batch, n in work]
    return filled + [(list(range(length)), 0)] * (most - len(work))


class FrozenPriors:
    """The held-out prompts' prior tokens from an AR model that does not train (a DiT run's): each prompt's
    are generated at its first evaluation, from its own seed as `sample_batch` would, and kept for the later
    ones, which would generate the same tokens again. At GLM-Image's size that AR pass is most of an
    evaluation's time."""

    def __init__(self, pipeline, sampling: EvalSampling):
        self.pipeline = pipeline
        self.sampling = sampling
        self.kept: dict[str, torch.Tensor] = {}

    def eval_tokens(self, texts: list[str]) -> torch.Tensor:
        """[B, L] the tokens of `texts`, generated once per prompt."""
        for text in texts:
            if text not in self.kept:
                self.kept[text] = prompt_prior_tokens(self.pipeline, text, self.sampling)
        return torch.cat([self.kept[t] for t in texts])


def prompt_prior_tokens(pipeline, text: str, sampling: EvalSampling) -> torch.Tensor:
    """[1, L] one held-out prompt's prior tokens from the AR model, from the prompt's own seed."""
    seed = prompt_seed(sampling.seed, text)
    return generate_prior_tokens(pipeline, [text], sampling.height, sampling.width, seed=seed)


@torch.no_grad()
def sample_batch(
    pipeline,
    texts: list[str],
    sampling: EvalSampling,
    device: torch.device,
    prior_tokens: Callable[[list[str]], torch.Tensor] | None = None,
) -> list:
    """One deterministic image per prompt of one batch (see the module docstring).

    `prior_tokens`: texts -> [B, L] tokens from a prior cache (`glm_training.priors`), made from the same
    seeds, instead of the AR model (which a cached run does not load).
    """
    seeds = [prompt_seed(sampling.seed, t) for t in texts]
    if prior_tokens is not None:
        prior = prior_tokens(texts)
    else:
        # One AR call per prompt: its tokens depend on its own seed only.
        prior = torch.cat([prompt_prior_tokens(pipeline, t, sampling) for t in texts])
    latents = seeded_latents(pipeline, seeds, sampling.height, sampling.width)
    return render_with_pipeline(
        pipeline,
        texts,
        prior.to(device),
        latents.to(device, pipeline.transformer.dtype),
        sampling.height,
        sampling.width,
        sampling.num_inference_steps,
        sampling.guidance_scale,
    )


def evaluate_prompts(
    pipeline,
    prompts: list[Prompt],
    reward_set,
    sampling: EvalSampling,
    *,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    num_grid_images: int | None = None,
    prior_tokens: Callable[[list[str]], torch.Tensor] | None = None,
    equal_calls: bool = False,
    watched: RewardSet | None = None,
    recogniser: OcrReward | None = None,
    image_stats: bool = False,
) -> tuple[dict[str, Any], list]:
    """Sample and score every prompt; ranks take whole batches and gather the scores.

    Returns (result dict as written to `<step>.json`, images in prompt order). Only the first
    `num_grid_images` images (all when None) travel to rank 0, which alone writes the grid; on other ranks
    the images list is empty. `equal_calls` (a model sharded with FSDP, whose every forward is a
    collective): every rank samples the same number of batches of the same size (`_rank_work`).
    `watched` adds the `watched` section, `recogniser` the `text_metrics` one (see the module docstring).
    """
    local = []  # (prompt index, image or None, {reward: score}, {watched reward: score}, text metrics)
    for batch, num_scored in _rank_work(len(prompts), sampling.batch_size, rank, world_size, equal_calls):
        texts = [prompts[i].text for i in batch]
        images = sample_batch(pipeline, texts, sampling, device, prior_tokens)[:num_scored]
        if not num_scored:
            continue
        batch, texts = batch[:num_scored], texts[:num_scored]
        metadata = [prompts[i].metadata for i in batch]
        parts = reward_set(images, texts, metadata)
        watched_parts = watched(images, texts, metadata) if watched is not None else {}
        for j, (i, image) in enumerate(zip(batch, images)):
            keep = num_grid_images is None or i < num_grid_images
            local.append(
                (
                    i,
                    image if keep else None,
                    {name: float(v[j]) for name, v in parts.items()},
                    {name: float(v[j]) for name, v in watched_parts.items()},
                    text_scores(recogniser, image, prompts[i]) if recogniser is not None else None,
                    image_record(image) if image_stats else None,
                )
            )
    gathered = sorted(
        dist.flatten(dist.gather_objects(local)) if world_size > 1 else local, key=lambda r: r[0]
    )
    per_reward = {name: torch.tensor([r[2][name] for r in gathered]) for name in reward_set.names}
    total = weighted_sum(per_reward, reward_set.weights, 1)
    result = {
        "num_prompts": len(prompts),
        "sampling": asdict(sampling),
        "reward_mean": total.mean().item(),
        "rewards": {
            name: {
                "weight": reward_set.weights[name],
                "mean": values.mean().item(),
                "per_prompt": values.tolist(),
            }
            for name, values in per_reward.items()
        },
        "total_per_prompt": total.tolist(),
        "prompts": [p.text for p in prompts],
    }
    if watched is not None:
        per_watched = {name: torch.tensor([r[3][name] for r in gathered]) for name in watched.names}
        result["watched"] = {
            name: {"mean": values.mean().item(), "per_prompt": values.tolist()}
            for name, values in per_watched.items()
        }
    if recogniser is not None:
        result["text_metrics"] = summarise_text_metrics([r[4] for r in gathered])
    if image_stats:
        result["image_stats"] = summarise([r[5] for r in gathered])
    return result, ([r[1] for r in gathered if r[1] is not None] if rank == 0 else [])


def eval_scalars(result: dict[str, Any]) -> dict[str, float]:
    """The scalars logged with the training step: the total mean and each reward's mean, each watched
    reward's mean (`eval/watched/<name>`), the text metrics (`eval/text/word_accuracy`, `eval/text/ned`)."""
    scalars = {"eval/reward_mean": result["reward_mean"]}
    scalars.update({f"eval/reward/{name}": r["mean"] for name, r in result["rewards"].items()})
    scalars.update({f"eval/watched/{name}": r["mean"] for name, r in result.get("watched", {}).items()})
    text = result.get("text_metrics")
    if text is not None and text["num_with_text"]:
        scalars["eval/text/word_accuracy"] = text["word_accuracy"]
        scalars["eval/text/ned"] = text["normalized_edit_distance"]
    scalars.update({f"eval/image/{name}": v for name, v in result.get("image_stats", {}).items()})
    return scalars


def grid_samples(result: dict[str, Any], images: list, num_images: int) -> tuple[list, list[str]]:
    """The first `num_images` images with captions (prompt, total reward, watched rewards, text metrics)."""
    shown = images[:num_images]
    captions = [
        caption(t, r, _caption_extras(result, i))
        for i, (t, r) in enumerate(zip(result["prompts"], result["total_per_prompt"]))
    ]
    return shown, captions[: len(shown)]


def _caption_extras(result: dict[str, Any], index: int) -> dict[str, float]:
    extras = {name: r["per_prompt"][index] for name, r in result.get("watched", {}).items()}
    text = result.get("text_metrics")
    row = text["per_prompt"][index] if text is not None else None
    if row is not None:
        extras.update({"word acc": row["word_accuracy"], "NED": row["normalized_edit_distance"]})
    return extras


def write_evaluation(
    folder: Path, step: int, result: dict[str, Any], grid_images: list, captions: list[str]
) -> Path:
    """`<folder>/<step>.json`, and `<step>.png` (the captioned grid) when there are images; the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step:06d}.json"
    path.write_text(json.dumps({"step": step, **result}, indent=2), encoding="utf-8")
    if grid_images:
        make_image_grid(grid_images, captions).save(folder / f"{step:06d}.png")
    return path


@dataclass
class EvaluatedWeights:
    """What `--checkpoint` / `--config` name: the run config, its step, the default output folder, and the
    pipeline with those weights (loaded only when `load()` is called, after every input is checked)."""

    cfg: Any
    step: int
    output: Path
    load: Callable[[], Any]


def evaluated_weights(args: argparse.Namespace, overrides: list[str]) -> EvaluatedWeights:
    """The weights `--checkpoint` (EMA as `--ema` says) or `--config` (the base model) name; every checkpoint
    error before any loading."""
    from glm_training.config import load_config, load_run_config
    from glm_training.models.placement import parse_dtype

    if args.checkpoint:
        from glm_training.export import inspect_checkpoints, load_pipeline_from_checkpoints

        # Every checkpoint error (damaged files, two DiT runs, other base models, --ema without EMA) before
        # any loading; a run folder gives its newest intact checkpoint.
        infos = inspect_checkpoints([Path(c) for c in args.checkpoint], use_ema=args.ema is True)
        checkpoints = [info.path for info in infos]
        # As in training: the EMA weights when the run kept them (unless --no-ema).
        use_ema = all(info.has_ema for info in infos) if args.ema is None else args.ema
        # Sampling settings come from the DiT run when one is given (it trained the decoder's sampling).
        main_index = next((i for i, info in enumerate(infos) if info.component == "dit"), 0)
        cfg = load_run_config(checkpoints[main_index] / "config.yaml", overrides)
        output = checkpoints[main_index].parent.parent / "eval" / "standalone"
        given = [info.component for info in infos]
        step = max(info.step for info in infos)
    else:
        cfg = load_config(["--config", args.config, *overrides], args.config)
        output = Path(cfg.trainer.output_dir or f"outputs/{cfg.run_name}-base") / "eval"
        given, step = [], 0

    def load() -> Any:
        dtype = parse_dtype(cfg.model.dtype)
        if args.checkpoint:
            # Adapters stay unmerged, as in the training-time evaluation (merging rounds differently in bf16).
            pipeline = load_pipeline_from_checkpoints(
                checkpoints, use_ema=use_ema, merge_lora=False, dtype=dtype
            )
        else:
            from diffusers import GlmImagePipeline

            from glm_training.models.wrapper import resolve_model_path

            path = resolve_model_path(cfg.model.name, cfg.model.tiny_seed, cfg.model.shape_layers())
            pipeline = GlmImagePipeline.from_pretrained(path, dtype=dtype)
        from glm_training.frozen_weights import apply_chained_weights

        apply_chained_weights(pipeline, cfg, given)
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    return EvaluatedWeights(cfg, step, Path(args.output) if args.output else output, load)

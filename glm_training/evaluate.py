"""Held-out evaluation: deterministic sampling on fixed prompts, every configured reward, an image grid.

Sampling is the pipeline's own deterministic path: the AR model writes each prompt's prior tokens from a
generator seeded by (eval.seed, prompt text), and the DiT decodes them with `GlmImagePipeline`'s ODE sampler
(no SDE noise) from initial latents drawn from the same seed. A prompt's image therefore depends only on the
weights, the prompt and the seed, not on which rank or batch it lands in, so two evaluations of the same
weights give the same numbers. Each reward is reported as a mean and per prompt; the total is the weighted sum
of the raw scores (with one image per prompt there is no group to normalise within).

During training (`eval.every_n_steps`) the trainer calls `evaluate_prompts` on its live (or EMA) weights;
standalone:

    python -m glm_training.evaluate --checkpoint outputs/dit-run [--checkpoint outputs/ar-run] [eval.seed=1]
    python -m glm_training.evaluate --config configs/t2i_training.yaml      # the base model, untrained

Results go to `<output_dir>/eval/<step>.json` and `<step>.png` (`--output` to choose another folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from glm_training import distributed as dist
from glm_training.data import Prompt, PromptFileError, load_prompts
from glm_training.image_grid import caption, make_image_grid
from glm_training.rewards.combine import weighted_sum
from glm_training.rollout.dit import generate_prior_tokens, render_with_pipeline

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
    if cfg.component == "dit":
        steps, guidance = s.num_steps, s.guidance_scale
    else:  # the AR trainer decodes with the frozen DiT's own settings
        steps, guidance = s.dit_num_steps, s.dit_guidance_scale
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


def prompt_seed(seed: int, text: str) -> int:
    """A prompt's sampling seed: a function of the evaluation seed and the prompt text only."""
    return seed * 1_000_003 + zlib.crc32(text.encode("utf-8"))


@torch.no_grad()
def sample_images(pipeline, texts: list[str], sampling: EvalSampling, device: torch.device) -> list:
    """One deterministic image per prompt (see the module docstring)."""
    transformer = pipeline.transformer
    shape = (
        transformer.config.in_channels,
        sampling.height // pipeline.vae_scale_factor,
        sampling.width // pipeline.vae_scale_factor,
    )
    images = []
    for start in range(0, len(texts), sampling.batch_size):
        chunk = texts[start : start + sampling.batch_size]
        seeds = [prompt_seed(sampling.seed, t) for t in chunk]
        prior = torch.cat(
            [
                generate_prior_tokens(pipeline, [t], sampling.height, sampling.width, seed=x)
                for t, x in zip(chunk, seeds)
            ]
        )
        latents = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(x)) for x in seeds])
        images += render_with_pipeline(
            pipeline,
            chunk,
            prior.to(device),
            latents.to(device, transformer.dtype),
            sampling.height,
            sampling.width,
            sampling.num_inference_steps,
            sampling.guidance_scale,
        )
    return images


def evaluate_prompts(
    pipeline,
    prompts: list[Prompt],
    reward_set,
    sampling: EvalSampling,
    *,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[dict[str, Any], list]:
    """Sample and score every prompt; ranks split the prompts and gather the results.

    Returns (result dict as written to `<step>.json`, images in prompt order); on ranks other than 0 the
    images list is empty (only rank 0 writes the grid).
    """
    mine = list(range(rank, len(prompts), world_size))
    texts = [prompts[i].text for i in mine]
    images = sample_images(pipeline, texts, sampling, device) if mine else []
    parts = reward_set(images, texts, [prompts[i].metadata for i in mine]) if mine else {}
    local = [
        (i, image, {name: float(values[j]) for name, values in parts.items()})
        for j, (i, image) in enumerate(zip(mine, images))
    ]
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
    return result, ([r[1] for r in gathered] if rank == 0 else [])


def eval_scalars(result: dict[str, Any]) -> dict[str, float]:
    """The scalars logged with the training step: the total mean and each reward's mean."""
    scalars = {"eval/reward_mean": result["reward_mean"]}
    scalars.update({f"eval/reward/{name}": r["mean"] for name, r in result["rewards"].items()})
    return scalars


def grid_samples(result: dict[str, Any], images: list, num_images: int) -> tuple[list, list[str]]:
    """The first `num_images` images with captions (prompt and total reward)."""
    shown = images[:num_images]
    captions = [caption(t, r) for t, r in zip(result["prompts"], result["total_per_prompt"])]
    return shown, captions[: len(shown)]


def write_evaluation(
    folder: Path, step: int, result: dict[str, Any], images: list, num_grid_images: int
) -> Path:
    """`<folder>/<step>.json` (and `<step>.png`, the grid); returns the JSON path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step:06d}.json"
    path.write_text(json.dumps({"step": step, **result}, indent=2), encoding="utf-8")
    shown, captions = grid_samples(result, images, num_grid_images)
    if shown:
        make_image_grid(shown, captions).save(folder / f"{step:06d}.png")
    return path


# ---------------------------------------------------------------------------------------------------------
# Standalone


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.evaluate",
        description="Evaluate GLM-Image weights on held-out prompts with deterministic sampling.",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="a checkpoint folder (or a run folder: its newest checkpoint); twice for an AR plus a DiT run",
    )
    parser.add_argument(
        "--config", help="evaluate the base model of this training config instead of a checkpoint"
    )
    parser.add_argument("--output", help="folder for <step>.json and <step>.png (default: <run>/eval)")
    parser.add_argument("--ema", action="store_true", help="evaluate the checkpoint's EMA weights")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; config overrides are key=value, e.g. eval.seed=1")
    if bool(args.checkpoint) == bool(args.config):
        parser.error("give --checkpoint (trained weights) or --config (the base model), not both or neither")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from glm_training.cli import report_user_errors

    return report_user_errors(lambda: _evaluate(*parse_args(sys.argv[1:] if argv is None else argv)))


def _evaluate(args: argparse.Namespace, overrides: list[str]) -> str:
    from glm_training.checkpoint import read_checkpoint_state
    from glm_training.config import load_config, load_run_config
    from glm_training.rewards import RewardSet
    from glm_training.trainers.reward_trainer import setup_logging

    setup_logging(True)
    if args.checkpoint:
        from glm_training.export import load_pipeline_from_checkpoints, resolve_checkpoint

        checkpoints = [resolve_checkpoint(Path(c)) for c in args.checkpoint]
        states = [read_checkpoint_state(c) for c in checkpoints]
        # Sampling settings come from the DiT run when one is given (it trained the decoder's sampling).
        main_index = next((i for i, s in enumerate(states) if s.get("component") == "dit"), 0)
        cfg = load_run_config(checkpoints[main_index] / "config.yaml", overrides)
        step = max(int(s["step"]) for s in states)
        output = Path(args.output) if args.output else checkpoints[main_index].parent.parent / "eval"
    else:
        cfg = load_config(["--config", args.config, *overrides], args.config)
        step = 0
        output = (
            Path(args.output)
            if args.output
            else Path(cfg.trainer.output_dir or f"outputs/{cfg.run_name}-base") / "eval"
        )
    prompts = load_eval_prompts(cfg.eval)
    reward_set = RewardSet(cfg.reward.weight_map(), cfg.reward.options, cfg.reward.combine)
    reward_set.check_prompts([p.text for p in prompts], [p.metadata for p in prompts])
    sampling = eval_sampling(cfg)

    from glm_training.models.placement import parse_dtype

    dtype = parse_dtype(cfg.model.dtype)
    if args.checkpoint:
        pipeline = load_pipeline_from_checkpoints(checkpoints, use_ema=args.ema, dtype=dtype)
    else:
        from diffusers import GlmImagePipeline

        from glm_training.models.wrapper import resolve_model_path

        pipeline = GlmImagePipeline.from_pretrained(
            resolve_model_path(cfg.model.name, cfg.model.tiny_seed), dtype=dtype
        )
    device = dist.choose_device(0)
    pipeline.to(device)
    pipeline.set_progress_bar_config(disable=True)
    result, images = evaluate_prompts(pipeline, prompts, reward_set, sampling, device=device)
    reward_set.close()
    path = write_evaluation(output, step, result, images, cfg.eval.num_grid_images)
    print(json.dumps({"step": step, **eval_scalars(result)}))
    return f"evaluation written to {path}"


if __name__ == "__main__":
    raise SystemExit(main())

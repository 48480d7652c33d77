"""Images per GPU-second of each recipe: one step of each recipe's own algorithm and settings at its size
(1024²), on one GPU, through the in-memory trainer of the `dit` and `ar` sections (`training.train_step`).

A recipe's step on 8 GPUs holds far more samples per GPU (Flow-GRPO: 48 x 24 / 8 = 144) than a check can
afford, so each row trains one group of as many samples as one forward takes (the recipe's micro-batch,
at least 2 for a group): the DiT's rollout and update run micro-batch by micro-batch, so the time per image
at that batch is the time per image of the full step, give or take the step's fixed costs (the optimizer
step). The AR recipes decode the whole group at once, so at a larger batch their decoding costs less per
image (a step costs the same from batch 1 to 16 on an H200, docs/benchmarks.md): their row trains
`AR_SAMPLES` samples for two steps and times the warm second (the first compiles the decoding step).

images per GPU-second = samples / (the timed step's rollout + update seconds).

A recipe is named as in `configs/recipes/` (`settings.default_recipes`: the default rows), optionally followed
by `:key=value` config overrides (`flow_grpo_fast_ocr:model.compile_blocks=true`).
"""

from __future__ import annotations

from typing import Any

from glm_training.gpu_check.settings import Settings
from glm_training.gpu_check.training import train_step

AR_SAMPLES = 4


def parse_recipe(spec: str) -> tuple[str, list[str]]:
    """`name[:key=value...]` -> ("recipes/<name>", the overrides)."""
    name, *overrides = spec.split(":")
    return f"recipes/{name}", overrides


def recipe_run(spec: str) -> tuple[str, str, list[str]]:
    """(component, recipe, overrides) of one row: the recipe's group size and step count added."""
    from glm_training.config import load_config

    recipe, overrides = parse_recipe(spec)
    cfg = load_config(config=recipe, overrides=overrides)
    if cfg.component == "dit":
        samples, steps = max(2, cfg.sampling.micro_batch_size), 1
    else:
        samples, steps = AR_SAMPLES, 2
    sized = [f"data.num_generations={samples}", f"trainer.num_steps={steps}"]
    return cfg.component, recipe, [*sized, *overrides]


def images_per_second(result: dict[str, Any]) -> float:
    """Samples over the timed step's rollout and update (the last step's phases)."""
    phases = result["phases"]
    return result["samples"] / (phases["rollout"]["seconds"] + phases["update"]["seconds"])


def recipe_row(spec: str, pipe, settings: Settings, matmul: float | None, peak: float | None) -> dict:
    """The `recipes` section's row of `spec`: the training step's figures and images per GPU-second."""
    component, recipe, overrides = recipe_run(spec)
    result = train_step(component, pipe, settings, matmul, peak, recipe, overrides)
    return {**result, "spec": spec, "images_per_s": images_per_second(result)}

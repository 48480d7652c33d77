"""Shared body of the entry points: parse the command line, then train, print the config, or print help.

Hydra's own flags act here, before any model is loaded: `--cfg job|all|hydra` prints the resolved config and
`--help` the config groups and every key with its doc (`config/help.py`); both exit 0. Errors a user can
fix (bad config, prompt file, reward name, checkpoint folder, placement, an exhausted dynamic-sampling budget)
print one message naming the problem and the fix, and exit with status 2 (`errors.report_user_errors`). This
module imports no trainer: the entry points name the half they train ("dit" or "ar", and the config's
`algo.name` picks the algorithm from the algorithm table, `config/algorithms.py`), or pass a class or its
"module:Class" path; the trainer is imported only when training starts (so `--cfg` and `--help` answer in
about a second, without torch).

The quick-start configs (`configs/t2i_training.yaml`, ... : each algorithm's `AlgorithmSpec.config`) hold the
tiny model's sizes and learning rate; training the real GLM-Image from one is refused, naming that
algorithm's recipes in `configs/recipes/` (`docs/recipes.md`), so tiny settings never reach a real-model run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from glm_training.errors import report_user_errors

__all__ = ["REAL_MODEL", "check_not_quick_start", "recipes_by_algorithm", "report_user_errors", "run"]

REAL_MODEL = "zai-org/GLM-Image"  # configs/model/glm_image.yaml; tests train other names (tiny, fixtures)


def run(trainer_cls: type | str, default_config: str, argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), then train, print the config or print help; the exit status.

    `trainer_cls`: "dit" or "ar" (the trainer of the config's algorithm, for that half), "joint" (both
    halves, `train_joint.py`), a trainer class, or its "module:Class" path.
    """
    from glm_training.build import build_trainer
    from glm_training.config import compose_config, parse_command_line

    def main() -> str:
        command = parse_command_line(sys.argv[1:] if argv is None else argv, default_config)
        cfg = compose_config(command)
        if command.help:
            from glm_training.config.help import help_text

            return help_text(cfg, command, Path(sys.argv[0]).name)
        if command.print_config:
            from glm_training.config.help import print_config_text

            return print_config_text(cfg, command)
        check_not_quick_start(cfg, command)
        if trainer_cls in ("dit", "ar", "joint"):
            trainer = build_trainer(cfg, trainer_cls)
        else:
            trainer = _trainer_class(trainer_cls)(cfg)
        return f"done: outputs in {trainer.train()}"

    return report_user_errors(main)


def _trainer_class(trainer_cls: type | str) -> type:
    if isinstance(trainer_cls, str):
        module, _, name = trainer_cls.partition(":")
        return getattr(importlib.import_module(module), name)
    return trainer_cls


def recipes_by_algorithm() -> dict[str, list[str]]:
    """Each algorithm's recipes (`recipes/<name>`), by the schema each file's defaults list names."""
    from omegaconf import OmegaConf

    from glm_training.config import ALGORITHMS
    from glm_training.config.algorithms import JOINT_SCHEMA
    from glm_training.config.loading import RECIPE_DIR

    by_schema = {algorithm.schema: name for name, algorithm in ALGORITHMS.items()}
    by_schema[JOINT_SCHEMA] = "joint"
    recipes: dict[str, list[str]] = {}
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        for entry in OmegaConf.load(path).get("defaults", []):
            schema = entry.lstrip("/") if isinstance(entry, str) else None
            if schema in by_schema:
                recipes.setdefault(by_schema[schema], []).append(f"recipes/{path.stem}")
    return recipes


def check_not_quick_start(cfg: Any, command: Any) -> None:
    """Refuse to train the real GLM-Image from a quick-start config; the error names the recipes to use.

    A quick-start config is a shipped config named by an algorithm's `AlgorithmSpec.config`: its sizes, steps
    and learning rate are the tiny model's (`model=glm_image` on top of it would train the real model at
    64x64 with a full fine-tuning learning rate on LoRA).
    """
    from omegaconf import OmegaConf

    from glm_training.config import ALGORITHMS, CONFIG_DIR, ConfigError, algorithm_of
    from glm_training.config.algorithms import JOINT_CONFIG

    quick_starts = {algorithm.config for algorithm in ALGORITHMS.values()} | {JOINT_CONFIG}
    if cfg.model.name != REAL_MODEL or command.config_dir != CONFIG_DIR:
        return
    if command.config_name not in quick_starts:
        return
    path = CONFIG_DIR / f"{command.config_name}.yaml"
    shipped = OmegaConf.load(path)
    prefix = "dit." if cfg.component == "joint" else ""  # a joint config's DiT half holds its sizes
    height, width, steps, lr = (
        OmegaConf.select(shipped, prefix + key)
        for key in ("sampling.height", "sampling.width", "sampling.num_steps", "optim.lr")
    )
    sizes = [
        f"{height}x{width}" if height and width else "",
        f"{steps} steps" if steps else "",
        f"lr {_short(lr)}" if lr else "",
    ]
    held = ", ".join(s for s in sizes if s)
    algorithm = "joint" if cfg.component == "joint" else algorithm_of(cfg).name
    recipes = recipes_by_algorithm().get(algorithm, [])
    start = (
        "start from " + " or ".join(f"--config-name {r}" for r in recipes)
        if recipes
        else f"no recipe trains {algorithm} yet: write one in configs/recipes/ with GLM-Image's sizes"
    )
    raise ConfigError(
        "--config",
        f"configs/{command.config_name}.yaml holds the tiny model's sizes and learning rate"
        f"{f' ({held})' if held else ''}; for GLM-Image {start} (docs/recipes.md).",
    )


def _short(value: float) -> str:
    """1e-2 rather than 0.01 or 1e-02."""
    mantissa, _, exponent = f"{value:.0e}".partition("e")
    return f"{mantissa}e{int(exponent)}"

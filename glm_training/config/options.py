"""The config's building blocks: `option` (a field with its default and its `--help` text), the checks every
section runs in `__post_init__` (a `ConfigError` naming the key and the fix), and the choice lists the shared
sections read. Algorithm-specific choices live in each algorithm's `config.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

from glm_training.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
BUNDLED_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts_tiny.txt"
BUNDLED_EVAL_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts_eval.txt"


class ConfigError(UserError, ValueError):
    """A user-facing configuration error; the message names the key and the fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config key '{key}': {message}")


def option(
    default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None
) -> Any:
    """A config field with its `--help` text as field metadata (TRL's `field(metadata={"help": ...})`).

    `factory` makes a fresh default for each config (lists, dicts), as `field(default_factory=...)`.
    """
    metadata = {"help": " ".join(help.split())}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)


def check_resolution(height: int, width: int) -> None:
    """`sampling.height` and `sampling.width`: positive multiples of 32, as GLM-Image needs."""
    for key, value in (("height", height), ("width", width)):
        _check(
            value > 0 and value % 32 == 0,
            f"sampling.{key}",
            f"GLM-Image needs a multiple of 32, got {value}; try {max(32, round(value / 32) * 32)}.",
        )


def _check_choice(value: Any, choices: tuple, key: str) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(key, f"'{value}' is not one of {list(choices)}.{hint}")


RUN_NAME_HELP = "names the default output folder outputs/<run_name>-<time> and the tracker run"
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "cpu", "cuda")
# The choices of keys that pick an entry of a dispatch table elsewhere (named beside each). They are spelt
# here, not imported from those tables, so that `--help` and `--cfg` answer without loading torch;
# tests/test_config.py checks that each equals the keys of its table.
SCALE_REWARDS = ("group", "batch", "none")  # engine/advantages.py ADVANTAGE_FNS
REWARD_COMBINES = ("weighted_sum", "normalized_sum")  # rewards/combine.py COMBINE_FNS
STRATEGIES = ("ddp", "fsdp")  # distributed/strategies.py STRATEGIES
EMA_CALLS = ("per_train_batch", "per_optimizer_step", "per_rollout")  # engine/ema.py EMA_CALL_FNS
CHECKPOINT_FORMATS = ("gathered", "sharded")

"""Shared body of the entry points: parse the config, build the trainer, train.

Errors a user can fix (bad config, prompt file, reward name, checkpoint folder, placement, an exhausted
dynamic-sampling budget) print one message naming the problem and the fix, and exit with status 2
(`errors.report_user_errors`). This module imports no trainer: the entry points pass their class in.
"""

from __future__ import annotations

import sys

from glm_training.errors import report_user_errors

__all__ = ["report_user_errors", "run"]


def run(trainer_cls: type, default_config: str, argv: list[str] | None = None) -> int:
    from glm_training.config import load_config

    def train() -> str:
        cfg = load_config(sys.argv[1:] if argv is None else argv, default_config)
        return f"done: outputs in {trainer_cls(cfg).train()}"

    return report_user_errors(train)

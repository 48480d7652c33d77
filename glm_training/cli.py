"""Shared body of the entry points: parse the command line, then train, print the config, or print help.

Hydra's own flags act here, before any model is loaded: `--cfg job|all|hydra` prints the resolved config and
`--help` the config groups and every key with its doc (`config/help.py`); both exit 0. Errors a user can
fix (bad config, prompt file, reward name, checkpoint folder, placement, an exhausted dynamic-sampling budget)
print one message naming the problem and the fix, and exit with status 2 (`errors.report_user_errors`). This
module imports no trainer: the entry points name the half they train ("dit" or "ar", and the config's
`algo.name` picks the trainer from the algorithm table, `config/algorithms.py`), or pass a class or its
"module:Class" path; the trainer is imported only when training starts (so `--cfg` and `--help` answer in
about a second, without torch).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from glm_training.errors import report_user_errors

__all__ = ["report_user_errors", "run"]


def run(trainer_cls: type | str, default_config: str, argv: list[str] | None = None) -> int:
    """Parse `argv` (default: `sys.argv[1:]`), then train, print the config or print help; the exit status.

    `trainer_cls`: "dit" or "ar" (the trainer of the config's algorithm, for that half), a trainer class,
    or its "module:Class" path.
    """
    from glm_training.config import build_trainer, compose_config, parse_command_line

    def main() -> str:
        command = parse_command_line(sys.argv[1:] if argv is None else argv, default_config)
        cfg = compose_config(command)
        if command.help:
            from glm_training.config.help import help_text

            return help_text(cfg, command, Path(sys.argv[0]).name)
        if command.print_config:
            from glm_training.config.help import print_config_text

            return print_config_text(cfg, command)
        if trainer_cls in ("dit", "ar"):
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

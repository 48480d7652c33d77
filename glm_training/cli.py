"""Shared body of the entry points: parse the config, build the trainer, train; user errors exit 2."""

from __future__ import annotations

import sys

from glm_training.config import ConfigError, load_config

# Errors whose message already tells the user what to change: printed without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError,)


def run(trainer_cls: type, default_config: str, argv: list[str] | None = None) -> int:
    from glm_training.checkpoint import CheckpointError
    from glm_training.data import PromptFileError
    from glm_training.models.placement import PlacementError

    user_errors = USER_ERRORS + (CheckpointError, PromptFileError, PlacementError, FileExistsError)
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv, default_config)
        trainer = trainer_cls(cfg)
        output_dir = trainer.train()
    except user_errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        # Reward/registry/prompt validation raise ValueError with a remedy in the message.
        if getattr(err, "__module__", "").startswith("glm_training") or _raised_here(err):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise
    print(f"done: outputs in {output_dir}")
    return 0


def _raised_here(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "glm_training" in tb.tb_frame.f_code.co_filename

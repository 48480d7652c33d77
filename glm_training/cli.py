"""Shared body of the entry points: parse the config, build the trainer, train.

Errors a user can fix (bad config, prompt file, reward name, checkpoint folder, placement, an exhausted
dynamic-sampling budget) print one message naming the problem and the fix, and exit with status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def run(trainer_cls: type, default_config: str, argv: list[str] | None = None) -> int:
    from glm_training.config import load_config

    def train() -> str:
        cfg = load_config(sys.argv[1:] if argv is None else argv, default_config)
        return f"done: outputs in {trainer_cls(cfg).train()}"

    return report_user_errors(train)


def report_user_errors(body: Callable[[], str]) -> int:
    """Run `body`: a user error prints one line and returns 2; success prints `body`'s message, returns 0."""
    from glm_training.checkpoint import CheckpointError
    from glm_training.config import ConfigError
    from glm_training.data import PromptFileError
    from glm_training.models.placement import PlacementError
    from glm_training.rewards.remote import RemoteRewardError
    from glm_training.tracking import TrackerError
    from glm_training.trainers.ar_trainer import DynamicSamplingExhausted

    user_errors = (
        ConfigError,
        CheckpointError,
        PromptFileError,
        PlacementError,
        DynamicSamplingExhausted,
        FileExistsError,
        RemoteRewardError,
        TrackerError,
    )
    try:
        message = body()
    except user_errors as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        # The reward registry and reward checks raise ValueError with the remedy in the message; a
        # ValueError from deeper down (torch, diffusers) is a bug and keeps its traceback.
        if not _raised_in_project(err):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(message)
    return 0


def _raised_in_project(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/glm_training/" in tb.tb_frame.f_code.co_filename

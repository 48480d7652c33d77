"""Errors a user can fix, and how the command-line entry points report them.

`UserError` is the base of every error whose message names the problem and the fix (a bad config key, a
missing prompt file, a checkpoint that does not match, an unplaceable model, ...). Each module keeps its own
subclass beside the code that raises it; the entry points catch the base class, so this module imports
nothing from the project and every module may import it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """An error caused by the user's input; the message says what is wrong and how to fix it."""


def report_user_errors(body: Callable[[], str]) -> int:
    """Run `body`: a user error prints one line and returns 2; success prints `body`'s message (if any) and
    returns 0."""
    try:
        message = body()
    except (UserError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        # The reward registry and reward checks raise ValueError with the remedy in the message; a
        # ValueError from deeper down (torch, diffusers) is a bug and keeps its traceback.
        if not _raised_in_project(err):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    if message:
        print(message)
    return 0


def _raised_in_project(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "/glm_training/" in tb.tb_frame.f_code.co_filename

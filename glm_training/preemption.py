"""Graceful stops: SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) finish the current step, checkpoint, and exit 0.

Slurm (`--signal=USR1@90`, or SIGTERM at the time limit), Kubernetes (SIGTERM, then SIGKILL after the grace
period) and torchrun's elastic agent all preempt with a signal; a person presses Ctrl-C. The handler only
records the request; the training loop asks `StopSignals.agreed()` once per step, after the update, at a
point every rank reaches, and all ranks stop at the same step (an all-reduce of the flag with MAX), so a
signal that reached one rank never leaves the others waiting in a collective.

A second signal means "now": the process exits at once with 128 + the signal number, as a shell reports a
death by that signal. The same signal again within `REPEAT_S` is the first one arriving twice (Ctrl-C under
torchrun reaches each rank from the terminal and again from the agent, which forwards it) and changes
nothing. Under torchrun the agent kills its ranks 30 s after it forwards a signal: a step longer than that is
lost to Ctrl-C there; signal the ranks instead, or let Slurm do it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from glm_training.distributed import collectives as dist

logger = logging.getLogger("glm_training")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_S = 1.0  # the same signal again within this many seconds is the first one delivered twice


class StopSignals:
    """Installs the handlers on `install()` and puts the previous ones back on `restore()`."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal's number
        self.received_at = 0.0  # and when (time.monotonic())
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        import threading

        # Python runs handlers in the main thread only; a trainer built elsewhere simply has no handlers.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        del frame
        name = signal.Signals(signum).name
        if signum == self.received and time.monotonic() - self.received_at < REPEAT_S:
            return  # the first signal, delivered again (Ctrl-C under torchrun)
        if self.received is not None:
            # stderr directly: the logging module is not safe to re-enter from a signal handler mid-emit.
            rank = os.environ.get("RANK", "0")
            sys.stderr.write(f"[rank {rank}] second stop signal ({name}): exiting now\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.received, self.received_at = signum, time.monotonic()
        sys.stderr.write(
            f"[rank {os.environ.get('RANK', '0')}] {name} received: finishing the current step, then "
            "writing a checkpoint and exiting (send it again to exit at once)\n"
        )
        sys.stderr.flush()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def agreed(self) -> bool:
        """Whether any rank was asked to stop; a collective, so every rank calls it at the same point."""
        return dist.any_rank(self.requested)

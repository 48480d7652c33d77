"""`Checkpointer`: a run's checkpoints over the policy's state and the algorithm's own
(`glm_training/checkpoint/` writes and reads the files: atomic, hashed, sharded under FSDP).

Saving is collective. With `trainer.async_save` a checkpoint's sharded weights and optimizer state may be
written in the background; it becomes final at the next save (or the run's end), so at most one is in flight.
Resuming: rank 0 checks the hashes and tells the others which checkpoint to load, or the error, so that no
rank waits in a collective for one that failed (`agreed`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from glm_training.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_paired_resume,
    find_resume,
    later_checkpoints,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_checkpoint_state,
    save_checkpoint,
    set_aside,
)
from glm_training.config import config_to_yaml
from glm_training.distributed import collectives as dist
from glm_training.errors import UserError

logger = logging.getLogger("glm_training")
T = TypeVar("T")


class OutputDirError(UserError):
    """`trainer.output_dir` cannot hold this run: it cannot be made or written, or it holds another run."""


def resolve_output_dir(cfg: Any, is_main: bool, halves: tuple[str, ...] = ("",)) -> tuple[Path, bool]:
    """The run's folder (chosen once by rank 0 when `trainer.output_dir` is empty), made by rank 0, and
    whether this call made it. Refused,
    on every rank alike, when it cannot be made or written, or when `trainer.resume` is not set and it
    already holds another run's checkpoints (in the sub-folders `halves`, a joint run's) or metrics."""
    name = cfg.trainer.output_dir
    if not name:
        name = dist.broadcast_object(f"outputs/{cfg.run_name}-{datetime.now():%Y%m%d-%H%M%S}")
    path = Path(name).expanduser()
    if cfg.trainer.resume is None and any(list_checkpoints(path / half) for half in halves):
        raise FileExistsError(
            f"'{path}' already holds checkpoints of another run; continue it with trainer.resume=latest, "
            "or choose a new trainer.output_dir (checkpoints are never overwritten)."
        )
    made = is_main and not path.exists()
    error = dist.broadcast_object(_output_dir_problem(path, cfg.trainer.resume) if is_main else "")
    if error:
        raise OutputDirError(error)
    logger.info("outputs go to %s", path)
    return path, made


def _output_dir_problem(path: Path, resume: str | None) -> str:
    """Rank 0: make `path`; what is wrong with it as this run's folder, or "" (made and writable)."""
    metrics = path / "metrics.jsonl"
    if resume is None and metrics.is_file() and metrics.stat().st_size:
        return (
            f"trainer.output_dir: '{path}' holds the metrics.jsonl of another run, which has no checkpoint "
            "to resume; choose a new trainer.output_dir (a run never appends to another's metrics)."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        return (
            f"trainer.output_dir: '{path}' cannot be made or written ({type(err).__name__}: "
            f"{err.strerror or err}); choose a folder this user can write."
        )
    return ""


def agreed(decide: Callable[[], T], is_main: bool) -> T:
    """Collective: rank 0's `decide()` on every rank, or its error raised on every rank as a `CheckpointError`
    (a refusal, or a file it could not read or rename), so that no rank waits in a collective for one that
    failed."""
    choice: tuple[T | None, str] = (None, "")
    if is_main:
        try:
            choice = (decide(), "")
        except CheckpointError as err:
            choice = (None, str(err))
        except (OSError, ValueError, KeyError) as err:  # e.g. an unreadable trainer_state.json
            choice = (None, f"trainer.resume: reading the checkpoints failed: {type(err).__name__}: {err}")
    value, error = dist.broadcast_object(choice)
    if error:
        raise CheckpointError(error)
    return value


class Checkpointer:
    """Saves and resumes `policy` (weights, optimizer, schedule, EMA) and the own state of each of `parts`
    (the algorithm, the monitors: `part.state()`: {file name: object}, restored by
    `part.load_state(folder)`). `prunes`: delete all but the newest `trainer.keep_last` checkpoints after each
    save (a joint run's halves prune together once both saved: `PairedCheckpoints`)."""

    def __init__(
        self,
        cfg: Any,
        output_dir: Path,
        policy: Any,
        parts: list[Any],
        rank: int,
        is_main: bool,
        prunes: bool = True,
    ):
        self.cfg = cfg
        self.output_dir = output_dir
        self.policy = policy
        self.parts = parts
        self.rank = rank
        self.is_main = is_main
        self.prunes = prunes
        self.pending = None  # a checkpoint being written in the background (trainer.async_save)
        self.background_group = None

    def save(self, step: int, at_once: bool = True) -> None:
        """Write the checkpoint of `step` (every rank); see the module docstring for `at_once`."""
        self.finish_pending()
        background = None
        if self.cfg.trainer.async_save and not at_once:
            if self.background_group is None:
                # Collective: every rank, at the same step.
                self.background_group = dist.background_group(self.cfg.trainer.dist_timeout_s)
            background = self.background_group
            logger.info("checkpoint of step %d: writing in the background", step)
        policy = self.policy
        self.pending = save_checkpoint(
            self.output_dir,
            step,
            module=policy.trainable,
            optimizer=policy.optimizer,
            lr_scheduler=policy.lr_scheduler,
            ema_state=policy.parallel.ema_state(policy.ema) if policy.ema is not None else None,
            config_yaml=config_to_yaml(self.cfg),
            component=policy.component,
            rank=self.rank,
            is_main=self.is_main,
            barrier=dist.barrier,
            parallel=policy.parallel,
            extra_files={name: obj for part in self.parts for name, obj in part.state().items()},
            background_group=background,
        )
        if self.pending.done:
            self._after_checkpoint()

    def finish_pending(self) -> None:
        """Collective: wait for the checkpoint being written in the background, if any, and make it final."""
        if self.pending is not None and not self.pending.done:
            self.pending.finish()
            self._after_checkpoint()

    def _after_checkpoint(self) -> None:
        if self.prunes:
            self.prune()
        else:
            dist.barrier()

    def prune(self) -> None:
        """Collective: delete all but the newest `trainer.keep_last` complete checkpoints."""
        if self.is_main:
            prune_checkpoints(self.output_dir, self.cfg.trainer.keep_last)
        dist.barrier()

    def resume(self) -> int:
        """Load `trainer.resume`'s checkpoint into the policy and the parts; the step it was written at
        (0 without `trainer.resume`)."""
        resume = self.cfg.trainer.resume
        if not resume:
            return 0
        return self.load(agreed(lambda: self._resume_point(resume), self.is_main))

    def load(self, path: Path) -> int:
        """Collective: load checkpoint `path` into the policy and the parts; the step it was written at."""
        policy = self.policy
        step, ema_state = load_checkpoint(
            path,
            module=policy.trainable,
            optimizer=policy.optimizer,
            lr_scheduler=policy.lr_scheduler,
            rank=self.rank,
            parallel=policy.parallel,
        )
        if policy.ema is not None and ema_state is not None:
            policy.parallel.load_ema_state(policy.ema, ema_state)
        for part in self.parts:
            part.load_state(path)
        logger.info("resumed from %s at step %d", path, step)
        return step

    def _resume_point(self, resume: str) -> Path:
        """Rank 0: the checkpoint to resume from. The damaged ones `latest` passed over are set aside (so the
        run writes their steps again); later intact ones in this run's folder, which the run would have to
        overwrite, are refused before the first step."""
        path, damaged = find_resume(resume, self.output_dir)
        for checkpoint in damaged:
            set_aside(checkpoint)
        later = later_checkpoints(self.output_dir, read_checkpoint_state(path)["step"])
        if later:
            raise CheckpointError(
                f"trainer.resume='{resume}' is {path.name}, but '{self.output_dir}' already holds the later "
                f"checkpoints {[p.name for p in later]}, which this run would write again (checkpoints are "
                "never overwritten); resume with trainer.resume=latest, or write this run to a new "
                "trainer.output_dir."
            )
        return path


class PairedCheckpoints:
    """The checkpoints of a run that trains several halves (a joint run's AR and DiT): one `Checkpointer` each
    (built with `prunes=False`), saved one after the other and pruned together once all saved, so that a stop
    between two saves always leaves a step every half completed.

    `trainer.resume=latest` resumes every half from the newest step all of them saved intact
    (`find_paired_resume`); the checkpoints past it are set aside (renamed, kept, logged): the newer halves'
    of a stop between the saves as `step-N.unpaired`, damaged ones as `step-N.damaged`; the run writes those
    steps again. With no such step (a stop between the first two saves) it starts over from step 0.
    """

    def __init__(self, *halves: Checkpointer):
        self.halves = halves

    def save(self, step: int, at_once: bool = True) -> None:
        for half in self.halves:
            half.save(step, at_once)
        self._prune()

    def finish_pending(self) -> None:
        for half in self.halves:
            half.finish_pending()
        self._prune()

    def _prune(self) -> None:
        for half in self.halves:
            half.prune()

    def resume(self) -> int:
        if not self.halves[0].cfg.trainer.resume:
            return 0
        step = agreed(self._resume_step, self.halves[0].is_main)
        if step:
            for half in self.halves:
                half.load(checkpoint_dir(half.output_dir, step))
        return step

    def _resume_step(self) -> int:
        """Rank 0: the newest step every half saved intact, the checkpoints past it set aside."""
        step, passed = find_paired_resume([half.output_dir for half in self.halves])
        for checkpoint, why in passed:
            set_aside(checkpoint, why)
        if step == 0:
            logger.warning("no step has a checkpoint of both halves: the run starts over from step 0")
        return step

"""Writing a checkpoint atomically: into `step-NNNNNN.tmp`, hashed, then renamed into place.

A crash mid-save never leaves a half checkpoint that `resume=latest` would pick up, and an existing
checkpoint is never overwritten. With `trainer.async_save` the sharded weights and optimizer state are
written in the background and the checkpoint becomes final when `PendingCheckpoint.finish()` is called.
"""

from __future__ import annotations

import json
import logging
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.checkpoint.integrity import write_hashes
from glm_training.checkpoint.layout import (
    CONFIG_FILE,
    EMA_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    CheckpointError,
    checkpoint_dir,
)
from glm_training.checkpoint.rng import rng_state

logger = logging.getLogger("glm_training.checkpoint")


def save_checkpoint(
    output_dir: Path,
    step: int,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    ema_state: dict | None,
    config_yaml: str,
    component: str,
    rank: int,
    is_main: bool,
    barrier,
    parallel: Any,
    extra_files: dict[str, Any] | None = None,
    background_group: Any = None,
) -> PendingCheckpoint:
    """Write the checkpoint of `step`; every rank calls this (each stores its own RNG state).

    `parallel` (`distributed/strategies.py`) writes the weights and optimizer state (`save_state`): gathered
    to rank 0 (`trainable.safetensors`, `optimizer.pt`; under FSDP a collective, the optimizer state keyed by
    parameter name), or, with `trainer.checkpoint_format=sharded`, each rank its own part (`shards/`, DCP).
    `extra_files` ({file name: object for `torch.save`}) is a trainer's own state (e.g.
    DiffusionNFT's old model), written inside the same atomic folder.

    Returns the checkpoint as a `PendingCheckpoint`, already final (`.final`) unless `background_group` made
    the sharded weights and optimizer state write in the background (`trainer.async_save`): then it becomes
    a checkpoint when `.finish()` is called, by every rank. Until then it is a `.tmp` folder, which
    `list_checkpoints` ignores: a run killed meanwhile resumes from the checkpoint before.
    """
    final = checkpoint_dir(output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    stepped = bool(optimizer.state)  # before the first optimizer step there is no state
    if is_main:
        _start_folder(final, tmp)
    barrier()
    torch.save(rng_state(), tmp / RNG_FILE.format(rank=rank))
    writing = parallel.save_state(module, optimizer, tmp, is_main, stepped, background_group)
    if is_main:
        torch.save(lr_scheduler.state_dict(), tmp / SCHEDULER_FILE)
        if ema_state is not None:
            torch.save(ema_state, tmp / EMA_FILE)
        for name, state in (extra_files or {}).items():
            torch.save(state, tmp / name)
        (tmp / CONFIG_FILE).write_text(config_yaml, encoding="utf-8")
    state = {
        "step": step,
        "component": component,
        "sharded": parallel.sharded,
        "format": parallel.checkpoint_format,
        "optimizer_stepped": stepped,
    }
    pending = PendingCheckpoint(tmp, final, state, is_main, barrier, writing)
    if writing is None:
        pending.finish()
    return pending


def _start_folder(final: Path, tmp: Path) -> None:
    """Rank 0: refuse to overwrite `final`; an empty `tmp` folder (a `.tmp` a crash left is cleared)."""
    if final.exists():
        raise CheckpointError(
            f"refusing to overwrite the existing checkpoint {final} (checkpoints are never overwritten); "
            "continue from it with trainer.resume=latest, or move it aside, or write this run to a new "
            "trainer.output_dir."
        )
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


class PendingCheckpoint:
    """A checkpoint folder whose files are written (or being written in the background); `finish()` waits for
    the writing, then rank 0 hashes the files, writes the state file last and renames `.tmp` to its name."""

    def __init__(self, tmp: Path, final: Path, state: dict, is_main: bool, barrier, writing: Future | None):
        self.tmp, self.final, self.state = tmp, final, state
        self.is_main, self.barrier, self.writing = is_main, barrier, writing
        self.done = False

    def finish(self) -> Path:
        """Collective (every rank): make the checkpoint final; idempotent."""
        if self.done:
            return self.final
        if self.writing is not None:
            self.writing.result()  # this rank's part, and on the coordinating rank the metadata
        self.barrier()
        if self.is_main:
            _finalize(self.tmp, self.final, self.state)
        self.barrier()
        self.done = True
        return self.final


def _finalize(tmp: Path, final: Path, state: dict) -> None:
    write_hashes(tmp)
    # Written last: a folder without it is incomplete and ignored by `list_checkpoints`.
    (tmp / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
    tmp.rename(final)
    logger.info("saved checkpoint %s", final)

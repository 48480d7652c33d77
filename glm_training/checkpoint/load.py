"""Restoring a run from a checkpoint: weights, optimizer, LR scheduler, RNG streams and EMA.

Every `torch.load` uses `weights_only=True`: a checkpoint is data, and loading one never runs code from its
pickles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.checkpoint.layout import (
    EMA_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    CheckpointError,
    read_checkpoint_state,
)
from glm_training.checkpoint.rng import set_rng_state


def load_checkpoint(
    path: Path,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    rank: int,
    parallel: Any,
) -> tuple[int, dict | None]:
    """Restore everything `save_checkpoint` wrote; returns (step, EMA state or None).

    `parallel` (`distributed/strategies.py`) loads the weights and optimizer state: under FSDP a collective,
    rank 0 reads them and they are scattered to every rank's shards.
    """
    state = read_checkpoint_state(path)
    step = int(state["step"])
    sharded = parallel.sharded
    # A sharded-format checkpoint is keyed by parameter name in its every part: any strategy and number of
    # ranks reads it. A gathered one's optimizer state has the layout of the strategy that wrote it.
    if state.get("format") != "sharded" and bool(state.get("sharded", False)) != sharded:
        written = "fsdp" if state.get("sharded") else "ddp"
        now = "sharded" if sharded else "unsharded (ddp, or fsdp in one process)"
        raise CheckpointError(
            f"'{path}' was written by a {'sharded' if state.get('sharded') else 'unsharded'} run "
            f"(trainer.strategy={written}) and this one is {now}: their optimizer states differ in layout. "
            f"Resume with trainer.strategy={written}{' on 2 or more ranks' if written == 'fsdp' else ''}, or "
            f"start a new run from its weights (model.dit_weights / model.ar_weights={path})."
        )
    parallel.load_state(module, optimizer, path, rank, bool(state.get("optimizer_stepped", True)))
    lr_scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    rng_file = path / RNG_FILE.format(rank=rank)
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    ema_file = path / EMA_FILE
    ema = torch.load(ema_file, map_location="cpu", weights_only=True) if ema_file.is_file() else None
    return step, ema

"""Where a checkpoint's files are: the folder layout, its file names, and the state file marking it complete.

A checkpoint is `<output_dir>/checkpoints/step-000010/`, written into a temporary sibling folder
(`step-000010.tmp`) and renamed into place when complete; the state file (`trainer_state.json`) is written
last, so only a folder holding it is a checkpoint (`list_checkpoints`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from glm_training.errors import UserError

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "trainable.safetensors"
HASHES_FILE = "hashes.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "lr_scheduler.pt"
EMA_FILE = "ema.pt"
CONFIG_FILE = "config.yaml"
RNG_FILE = "rng_rank{rank}.pt"  # one per rank
# A sharded checkpoint (`trainer.checkpoint_format=sharded`): torch.distributed.checkpoint's folder (each
# rank's `.distcp` files and the `.metadata` index) holding {"model": trained weights, "optim": AdamW state},
# in place of WEIGHTS_FILE and OPTIMIZER_FILE.
SHARDS_DIR = "shards"


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be found or does not match the model; the message says which and why."""


CHECKPOINT_LAYOUT = (
    f"a checkpoint folder is <output_dir>/checkpoints/{CHECKPOINT_PREFIX}NNNNNN/ holding {STATE_FILE}, "
    f"{WEIGHTS_FILE} and {CONFIG_FILE} (and {EMA_FILE} for algo.ema=true runs); a run folder is the "
    "trainer.output_dir that holds checkpoints/"
)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(output_dir: Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    # Only finished folders: a save cut short leaves `step-NNNNNN.tmp`, which must never be resumed from.
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
    return sorted((p for p in found if (p / STATE_FILE).is_file()), key=lambda p: p.name)


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `trainer_state.json`: {"step": N, "component": "dit" | "ar"}."""
    return json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))

"""Checkpoints: trainable weights, optimizer, LR scheduler, EMA, RNG and step, written atomically.

A checkpoint is `<output_dir>/checkpoints/step-000010/`, written into a temporary sibling folder and renamed
into place when complete, so a crash mid-save never leaves a half checkpoint that `resume=latest` would pick
up, and an existing checkpoint is never overwritten. Only the trainable parameters are stored (the LoRA
adapters, or the whole component for full fine-tuning), as safetensors or as a sharded DCP folder; the
frozen rest is reloaded from `model.name`.

Integrity: `hashes.json` records the SHA-256 of every file. Resume checks them and refuses a checkpoint whose
file changed (bit rot, a copy cut short, a file edited by hand), naming the file; `resume=latest` then
falls back to the newest intact checkpoint. Every `torch.load` uses `weights_only=True`: a checkpoint is
data, and loading one never runs code from its pickles.

The modules: `layout.py` (file names, folders, the state file), `integrity.py` (hashes), `trainable.py`
(the trained parameters by name), `sharded.py` (DCP folders), `rng.py` (random streams), `save.py` (the
atomic write), `load.py` (restoring a run), `resume.py` (which checkpoint to resume from; damaged, unpaired,
later and pruned ones), `info.py` (a checkpoint read from outside a run).
"""

from glm_training.checkpoint.info import CheckpointInfo, read_checkpoint, resolve_checkpoint
from glm_training.checkpoint.integrity import file_sha256, verify_checkpoint, write_hashes
from glm_training.checkpoint.layout import (
    CHECKPOINT_LAYOUT,
    CHECKPOINT_PREFIX,
    CONFIG_FILE,
    EMA_FILE,
    HASHES_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    SHARDS_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    checkpoint_dir,
    list_checkpoints,
    read_checkpoint_state,
)
from glm_training.checkpoint.load import load_checkpoint
from glm_training.checkpoint.resume import (
    find_paired_resume,
    find_resume,
    later_checkpoints,
    prune_checkpoints,
    resolve_resume,
    set_aside,
)
from glm_training.checkpoint.rng import rng_state, set_rng_state
from glm_training.checkpoint.save import PendingCheckpoint, save_checkpoint
from glm_training.checkpoint.sharded import load_sharded_state, read_trained_weights, save_sharded_state
from glm_training.checkpoint.trainable import (
    check_trainable_names,
    load_trainable_state_dict,
    trainable_state_dict,
)

__all__ = [
    "CHECKPOINT_LAYOUT",
    "CHECKPOINT_PREFIX",
    "CONFIG_FILE",
    "EMA_FILE",
    "HASHES_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "SCHEDULER_FILE",
    "SHARDS_DIR",
    "STATE_FILE",
    "WEIGHTS_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "PendingCheckpoint",
    "check_trainable_names",
    "checkpoint_dir",
    "file_sha256",
    "find_paired_resume",
    "find_resume",
    "later_checkpoints",
    "list_checkpoints",
    "load_checkpoint",
    "load_sharded_state",
    "load_trainable_state_dict",
    "prune_checkpoints",
    "read_checkpoint",
    "read_checkpoint_state",
    "read_trained_weights",
    "resolve_checkpoint",
    "resolve_resume",
    "rng_state",
    "save_checkpoint",
    "save_sharded_state",
    "set_aside",
    "set_rng_state",
    "trainable_state_dict",
    "verify_checkpoint",
    "write_hashes",
]

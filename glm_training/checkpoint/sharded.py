"""Sharded checkpoints (`trainer.checkpoint_format=sharded`): torch.distributed.checkpoint (DCP) folders.

Every rank writes its own part of the trained weights and the AdamW state, keyed by parameter name, so a
folder loads under any strategy and number of ranks; `read_trained_weights` consolidates the weights of
either format in one process.
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from glm_training.checkpoint.layout import SHARDS_DIR, WEIGHTS_FILE
from glm_training.checkpoint.trainable import check_trainable_names


def _state_dict_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def _no_dist() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def _dcp_in_one_process():
    """DCP warns that it "assumes the intent" when there is no process group: here it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def save_sharded_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    stepped: bool,
    background_group: Any = None,
) -> Future | None:
    """Collective: every rank writes its own part of the trained weights and AdamW state (DCP).

    Under FSDP each rank writes its shards; replicated tensors (DDP) are written once. Keyed by parameter
    name, so the folder loads under any strategy and number of ranks (`load_sharded_state`).

    `background_group` (`distributed.collectives.background_group()`; `False` in one process): DCP's
    `async_save`, which copies this rank's part to host memory, returns, and writes it from a thread,
    coordinating over that group (not the training's, whose collectives go on meanwhile). Returns the write's
    future, or None when the write is done.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(module, options=_state_dict_options())}
    if stepped:  # before the first step there is no state (reading it would take a step of its own)
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=_state_dict_options())
    with _dcp_in_one_process():
        if background_group is None:
            dcp.save(state, checkpoint_id=str(folder), no_dist=_no_dist())
            return None
        return dcp.async_save(
            state,
            checkpoint_id=str(folder),
            process_group=background_group or None,
            no_dist=_no_dist(),
        )


def load_sharded_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, stepped: bool
) -> None:
    """Collective: a sharded checkpoint's weights and AdamW state into `module` (sharded or not) and
    `optimizer`; DCP reads each rank's part, whatever the number of ranks that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    names = set(_sharded_entries(folder, "model"))
    check_trainable_names(module, names)
    state: dict[str, Any] = {"model": get_model_state_dict(module, options=_state_dict_options())}
    if stepped:
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=_state_dict_options())
    with _dcp_in_one_process():
        dcp.load(state, checkpoint_id=str(folder), no_dist=_no_dist())
    set_model_state_dict(module, state["model"], options=_state_dict_options())
    if stepped:
        set_optimizer_state_dict(module, optimizer, state["optim"], options=_state_dict_options())


def _sharded_entries(folder: Path, prefix: str) -> dict[str, Any]:
    """{name: tensor metadata} of the `prefix` ("model" or "optim") entries of a DCP folder's index."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    return {
        key[len(prefix) + 1 :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix + ".")
    }


def read_trained_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trained weights as full CPU tensors by name: `trainable.safetensors`, or a sharded
    checkpoint consolidated in this one process (only the weights are read, not the AdamW state)."""
    step_dir = Path(step_dir)
    if not (step_dir / SHARDS_DIR).is_dir():
        return load_file(str(step_dir / WEIGHTS_FILE))
    import torch.distributed.checkpoint as dcp

    entries = _sharded_entries(step_dir / SHARDS_DIR, "model")
    weights = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in entries.items()}
    with _dcp_in_one_process():
        dcp.load({"model": weights}, checkpoint_id=str(step_dir / SHARDS_DIR), no_dist=True)
    return weights

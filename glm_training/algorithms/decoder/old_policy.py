"""`OldPolicy`: an EMA copy of the trained weights, DiffusionNFT's old model and AWM's KL anchor.

It starts equal to the policy and follows it after every update, `old <- d old + (1 - d) policy` (each
algorithm gives its own schedule of d), and is saved in every checkpoint under its own file name.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from glm_training.algorithms.decoder.forward_math import ema_update_
from glm_training.checkpoint import CheckpointError
from glm_training.distributed import sharding


class OldPolicy:
    """An EMA copy of the trainable weights: DiffusionNFT's old model (it samples and anchors v+ and v-),
    AWM's KL anchor.

    Unsharded, LoRA: the old adapter weights live beside the module and are swapped in (by reference, no
    copy) for the duration of `module()`; full fine-tuning: a frozen copy of the module. Sharded (FSDP): the
    old weights are shards like the parameters' (1/world each, full fine-tuning included), made at first
    use, and `module()` copies them into the parameters' shards and back (every unit resharded first, so no
    gathered copy of the other weights is used); a sharded module's own forward gathers them.
    """

    def __init__(self, module: nn.Module, lora: bool, file: str, sharded: bool = False):
        self.file = file  # its checkpoint file, named in errors
        self.module_ = module
        self.sharded = sharded
        self.copy: nn.Module | None = None
        self._weights: dict[str, torch.Tensor] | None = None
        self._swapped_in = False
        if sharded:
            return  # the module is sharded after this: the shards are copied at first use
        live = self._live()
        if lora:
            self._weights = {n: p.detach().clone() for n, p in live.items()}
        else:
            self.copy = copy.deepcopy(module).requires_grad_(False).eval()
            params = dict(self.copy.named_parameters())
            self._weights = {n: params[n] for n in live}

    def _live(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.module_.named_parameters() if p.requires_grad}

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:  # sharded: the policy's shards at first use (the old model starts equal)
            with torch.no_grad():
                self._weights = {n: p.detach().clone() for n, p in self._live().items()}
        return self._weights

    @contextlib.contextmanager
    def module(self) -> Iterator[nn.Module]:
        """The old model to call (under no_grad): the frozen copy, or the module with the old weights in."""
        if self.copy is not None or self._swapped_in:
            yield self.copy if self.copy is not None else self.module_
            return
        if self.sharded:
            with self._copied_in():
                yield self.module_
            return
        live = self._live()
        current = {n: p.data for n, p in live.items()}
        try:
            for n, p in live.items():
                p.data = self.weights[n].data
            yield self.module_
        finally:
            for n, p in live.items():
                p.data = current[n]

    @contextlib.contextmanager
    def _copied_in(self) -> Iterator[None]:
        sharding.reshard_all(self.module_)
        live = self._live()
        with torch.no_grad():
            stash = {n: p.detach().clone() for n, p in live.items()}
            for n, p in live.items():
                p.copy_(self.weights[n])
        self._swapped_in = True
        try:
            yield
        finally:
            self._swapped_in = False
            sharding.reshard_all(self.module_)
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(stash[n])

    def update(self, decay: float) -> None:
        """`old <- decay * old + (1 - decay) * current` (the reference's update after every rollout)."""
        live = self._live()
        names = list(live)
        ema_update_([self.weights[n] for n in names], [live[n] for n in names], decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on CPU (collective when sharded: the file is the one an unsharded run writes)."""
        return {n: sharding.full_tensor(w.detach()).cpu().clone() for n, w in self.weights.items()}

    def load_from(self, checkpoint: Path, written_by: str) -> None:
        """Load `<checkpoint>/<file>` (the folder rank 0 chose and verified for every rank); a missing file
        names the run that writes one (`written_by`)."""
        file = checkpoint / self.file
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing: the checkpoint was not written by {written_by}; resume it with the "
                "config it was trained with."
            )
        self.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.weights):
            raise CheckpointError(
                f"{self.file} does not match the model being trained; was it written with other "
                "model.lora settings?"
            )
        with torch.no_grad():
            for n, w in self.weights.items():
                sharding.copy_full_into_(w, state[n])

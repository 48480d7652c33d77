"""How the trained component is spread over the ranks: one strategy object, the same methods for each.

The trainer never asks which strategy it runs; it calls these methods at fixed points:

    parallel.loads_into_shards                  build the trained component empty, to be read when sharded
    parallel.shard(trainable, reference, weights)  after LoRA / checkpointing, before the optimizer is built
    model, optimizer = parallel.wrap(trainable, optimizer)
    with parallel.no_sync(model, last): ...     each backward of an optimizer step
    parallel.clip_grad_norm_(params, max_norm)  before each optimizer step
    with parallel.sampling(trainable): ...      rollouts and evaluation: the weights to sample with
    with parallel.evaluation_precision(ctx): ...
    parallel.equal_calls                        must every rank make the same forward calls?
    parallel.save_state / load_state            what a checkpoint holds (gathered or sharded), and back

* `DDP` (`trainer.strategy=ddp`, and any run in one process): every rank holds the whole component;
  accelerate wraps it in DistributedDataParallel (a no-op in one process), gradients are all-reduced at the
  last backward of each optimizer step only, rank 0 writes the checkpoint.
* `FSDP` (`trainer.strategy=fsdp` on 2 or more ranks): FSDP2 shards the component in place
  (`sharding.py`), gradients are reduce-scattered at every backward, sampling gathers the component once,
  and checkpoints are gathered to rank 0 (the same files a DDP run writes, optimizer state keyed by name)
  or, with `trainer.checkpoint_format=sharded`, written by every rank (DCP), for either strategy.

Handles of the trained component (`engine/policy.py`): `policy.trainable` is the module itself (LoRA
injected, sharded in place under FSDP): rollouts, evaluation and the KL reference call it. `policy.model` is
what `wrap` returned: the training forward passes call it, so DDP sees them (under FSDP it is `trainable`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from glm_training.checkpoint import (
    OPTIMIZER_FILE,
    SHARDS_DIR,
    WEIGHTS_FILE,
    CheckpointError,
    check_trainable_names,
    load_sharded_state,
    load_trainable_state_dict,
    save_sharded_state,
    trainable_state_dict,
)
from glm_training.config import ConfigError
from glm_training.distributed import sharding

logger = logging.getLogger("glm_training")


class DDP:
    """Every rank holds the whole trained component; accelerate's DDP all-reduces the gradients."""

    name = "ddp"
    sharded = False
    equal_calls = False  # each rank's forwards are its own
    loads_into_shards = False  # every rank loads the whole component

    def __init__(self, accelerator: Any, component: str, trainer_cfg: Any):
        self.accelerator = accelerator
        self.component = component
        self.cfg = trainer_cfg

    def shard(self, module: nn.Module, reference: nn.Module | None, weights: Path | None = None) -> None:
        """Nothing to shard: every rank keeps its full copy (loaded whole: `weights` is never given)."""
        if weights is not None:
            raise ValueError("ddp loads the trained component whole; it has no shards to read weights into")

    def wrap(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        # Placement is already done (`Policy._load`); accelerate only wraps (DDP).
        return self.accelerator.prepare(module, optimizer, device_placement=[False, False])

    def no_sync(self, model: nn.Module, last: bool) -> AbstractContextManager:
        """Gradients are all-reduced at the `last` backward of an optimizer step only."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float):
        return self.accelerator.clip_grad_norm_(params, max_norm)

    def sampling(self, module: nn.Module) -> AbstractContextManager:
        """The weights rollouts and evaluation sample with: the module as it is."""
        return contextlib.nullcontext()

    def evaluation_precision(self, policy_precision: Callable[[], AbstractContextManager]):
        """Evaluation computes in the weights' dtype (the pipeline's own precision)."""
        return contextlib.nullcontext()

    @property
    def checkpoint_format(self) -> str:
        """ "gathered" (rank 0 writes whole files) or "sharded" (each rank writes its part, DCP)."""
        return self.cfg.checkpoint_format

    def save_state(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: Path,
        is_main: bool,
        stepped: bool,
        background_group: Any = None,
    ) -> Future | None:
        """Write the trained weights and optimizer state into the checkpoint folder being written; with a
        `background_group` (sharded format only) the write goes on in the background: its future."""
        if self.checkpoint_format == "sharded":
            return save_sharded_state(module, optimizer, folder / SHARDS_DIR, stepped, background_group)
        weights, optimizer_state = self.gather_state(module, optimizer, is_main, stepped)
        if is_main:
            save_file(weights, str(folder / WEIGHTS_FILE))
            torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        return None

    def gather_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, stepped: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(trainable weights, optimizer state) for the checkpoint, on rank 0 ({} elsewhere)."""
        if not is_main:
            return {}, {}
        return trainable_state_dict(module), optimizer.state_dict()

    def ema_state(self, ema: Any) -> dict[str, Any]:
        """The EMA's state for the checkpoint (diffusers' `EMAModel.state_dict`, whole shadow tensors)."""
        return ema.state_dict()

    def load_ema_state(self, ema: Any, state: dict[str, Any]) -> None:
        ema.load_state_dict(state)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, rank: int, stepped: bool
    ) -> None:
        """Every rank reads the checkpoint's weights and optimizer state."""
        if (path / SHARDS_DIR).is_dir():
            load_sharded_state(module, optimizer, path / SHARDS_DIR, stepped)
            return
        load_trainable_state_dict(module, load_file(str(path / WEIGHTS_FILE)))
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))


class FSDP(DDP):
    """FSDP2: each rank holds ~1/N of the trained component, its gradients and its optimizer state."""

    name = "fsdp"
    sharded = True
    # Every forward through a sharded module is a collective: every rank must make the same calls.
    equal_calls = True

    def __init__(self, accelerator: Any, component: str, trainer_cfg: Any):
        super().__init__(accelerator, component, trainer_cfg)
        self.device = accelerator.device
        self.world_size = accelerator.num_processes
        self.loads_into_shards = trainer_cfg.fsdp_load_into_shards
        check_shard_size(trainer_cfg.fsdp_shard_size, self.world_size)

    def shard(self, module: nn.Module, reference: nn.Module | None, weights: Path | None = None) -> None:
        """Shard in place (one unit per DiT block / GLM decoder layer, then the root); the frozen reference
        copy of a full fine-tune the same way with the same precision policy, so the first KL is exactly 0.

        `weights`: the component's folder, when it was built on the meta device (`loads_into_shards`): each
        rank then reads its shards of both from the files (`loading.materialise_`; the reference's
        go to host memory with `fsdp_reference_offload`)."""
        t = self.cfg
        sharding.shard(
            module,
            self.component,
            self.device,
            self.world_size,
            t.mixed_precision,
            shard_size=t.fsdp_shard_size,
        )
        if reference is not None:
            sharding.shard(
                reference,
                self.component,
                self.device,
                self.world_size,
                t.mixed_precision,
                cpu_offload=t.fsdp_reference_offload,
                shard_size=t.fsdp_shard_size,
            )
        if weights is None:
            return
        from glm_training.distributed.loading import materialise_

        materialise_(module, weights, self.device)
        if reference is not None:
            if t.fsdp_reference_offload:
                materialise_(reference, weights, torch.device("cpu"), buffers_device=self.device)
            else:
                materialise_(reference, weights, self.device)

    def wrap(self, module: nn.Module, optimizer: torch.optim.Optimizer):
        return module, optimizer  # sharded in place: the module is its own wrapper

    def no_sync(self, model: nn.Module, last: bool) -> AbstractContextManager:
        """FSDP2 reduce-scatters at every backward: deferring it, as DDP does, would keep a full unsharded
        copy of the gradients on every rank, the memory sharding is there to save. The sums are the same."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float):
        return sharding.clip_grad_norm_(params, max_norm)

    def sampling(self, module: nn.Module) -> AbstractContextManager:
        """The component gathered once for a rollout or an evaluation (`trainer.fsdp_gather_for_rollout`,
        `sharding.gathered`), instead of every unit at every denoising step or generated token."""
        if self.cfg.fsdp_gather_for_rollout:
            return sharding.gathered(module, self.component)
        return contextlib.nullcontext()

    def evaluation_precision(self, policy_precision: Callable[[], AbstractContextManager]):
        """Sharded weights compute in the policy's dtype (bf16 under mixed precision), so evaluation runs
        under the same autocast as training."""
        return policy_precision()

    def ema_state(self, ema: Any) -> dict[str, Any]:
        """Collective: the EMA's state with whole shadow tensors (each is sharded like its parameter), so
        the file is the one a DDP run writes."""
        state = dict(ema.state_dict())
        state["shadow_params"] = [sharding.full_tensor(s).cpu() for s in ema.shadow_params]
        return state

    def load_ema_state(self, ema: Any, state: dict[str, Any]) -> None:
        """Whole shadow tensors (every rank read the file) into this rank's shards of the EMA."""
        shadows = ema.shadow_params
        full = state["shadow_params"]
        if len(full) != len(shadows):
            raise CheckpointError(
                f"the checkpoint's EMA holds {len(full)} shadow parameters for {len(shadows)} trained ones; "
                "it comes from another model or model.lora setting."
            )
        # The scalars only (diffusers deep-copies what it is given); the shadows stay sharded, loaded below.
        ema.load_state_dict({k: v for k, v in state.items() if k != "shadow_params"})
        with torch.no_grad():
            for shadow, value in zip(shadows, full):
                sharding.copy_full_into_(shadow, value)

    def gather_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, stepped: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective: the full weights and (once an optimizer step has run: gathering would first initialise
        the state with a step of its own, shifting AdamW's bias correction) the optimizer state, on rank 0."""
        weights = sharding.gathered_trainable_state(module)
        optimizer_state = sharding.gathered_optimizer_state(module, optimizer) if stepped else {}
        return weights, optimizer_state

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, rank: int, stepped: bool
    ) -> None:
        """Collective: rank 0 reads, every rank's shards receive; the names are checked on every rank
        first, so all refuse together. A sharded checkpoint: each rank reads its part (DCP), as under DDP."""
        if (path / SHARDS_DIR).is_dir():
            return super().load_state(module, optimizer, path, rank, stepped)
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            check_trainable_names(module, set(f.keys()))
        main = rank == 0
        weights = load_file(str(path / WEIGHTS_FILE)) if main else {}
        sharding.load_gathered_trainable_state(module, weights)
        if stepped:  # every rank reads the flag: all load, or none
            state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True) if main else {}
            sharding.load_gathered_optimizer_state(module, optimizer, state)


STRATEGIES: dict[str, type[DDP]] = {"ddp": DDP, "fsdp": FSDP}


def check_ranks(cfg: Any, world_size: int) -> None:
    """Refuses a run config whose step samples or FSDP shard groups `world_size` ranks cannot share."""
    cfg.data.per_rank_samples(world_size)
    if cfg.trainer.strategy == "fsdp" and world_size > 1:  # one process trains unsharded
        check_shard_size(cfg.trainer.fsdp_shard_size, world_size)


def check_shard_size(shard_size: int, world_size: int) -> None:
    """Refuses `trainer.fsdp_shard_size` that does not divide the ranks (0: shard over all)."""
    if shard_size and (shard_size > world_size or world_size % shard_size):
        raise ConfigError(
            "trainer.fsdp_shard_size",
            f"{shard_size} does not divide the {world_size} ranks; use a divisor (the GPUs of one "
            "node), or 0 to shard over all ranks.",
        )


def make_parallelism(trainer_cfg: Any, accelerator: Any, component: str) -> DDP:
    """The strategy `trainer.strategy` names; one process has nothing to shard and trains as DDP does."""
    name = trainer_cfg.strategy
    if name == "fsdp" and accelerator.num_processes == 1:
        logger.warning("trainer.strategy=fsdp in a single process: nothing to shard, training unsharded")
        name = "ddp"
    return STRATEGIES[name](accelerator, component, trainer_cfg)

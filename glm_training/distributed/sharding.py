"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for `trainer.strategy=fsdp`: sharding, clipping, checkpoints.

The trainable component is sharded in place: one shard unit per DiT transformer block or GLM decoder layer
(the half's `shard_units`, `models/halves.py`; the AR model's unused image-input towers are units too),
plus the root unit holding the rest (embeddings, heads, final norms). Every parameter is split along its
first dimension over the ranks, so each rank holds about 1/world of the component, its gradients and its
optimizer state. The module keeps
its class (FSDP2 subclasses it in place) and its parameter names, so the pipeline, the rollouts, the
reference pass and evaluation call the same object, and a forward call gathers each unit's parameters just
before it runs.

A forward through a sharded module is a collective: every rank must make the same calls in the same order.
The trainers give every rank the same number of micro-batches; the AR model's `generate()` runs in
transformers' `synced_gpus` mode (a rank that is done keeps stepping until all are); evaluation pads the
ranks with fewer prompt batches with a discarded batch (`evaluate.evaluate_prompts(equal_calls=True)`).

Mixed precision: with `trainer.mixed_precision=bf16` the policy computes with bf16 parameters and reduces
gradients in fp32 (the sharded master weights stay in their loaded dtype); otherwise the parameters'
own dtype throughout.

Checkpoints: `trainer.checkpoint_format=sharded` has each rank write its own part (DCP,
`checkpoint.save_sharded_state`). The default, `gathered`, gathers them (`torch.distributed.checkpoint.
state_dict` with `full_state_dict`): rank 0 writes the same `trainable.safetensors` a DDP run writes,
so export, chaining (`model.dit_weights`) and the hashes work unchanged, and a run may resume on another
number of ranks. The optimizer state is
written keyed by parameter name. The cost is rank 0's CPU memory for one full copy of the trainable
parameters and their optimizer state (for a full fine-tune of the 7B DiT in fp32: ~84 GB of host memory),
gathered one tensor at a time; loading broadcasts from rank 0, so only rank 0 reads the files.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import torch
from torch import nn

from glm_training.models.halves import model_half

logger = logging.getLogger(__name__)


@functools.cache
def _mesh(device_type: str, world_size: int, shard_size: int = 0):
    """The device mesh: flat (every rank holds 1/world), or HSDP's (replicate, shard) with `shard_size`
    ranks per shard group, consecutive ranks together (one node's GPUs under torchrun)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not shard_size or shard_size == world_size:
        return init_device_mesh(device_type, (world_size,))
    return init_device_mesh(
        device_type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def mixed_precision_policy(mixed_precision: str):
    """bf16 compute with fp32 gradient reduction for `bf16`; the parameters' own dtype for `no`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # The inputs keep their dtype (`cast_forward_inputs=False`): autocast decides each op's precision, as it
    # does unsharded. Cast to bf16, the DiT's timestep would be rounded (986.3 -> 988) and condition
    # every block on another time than the pipeline's.
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def shard(
    module: nn.Module,
    component: str,
    device: torch.device,
    world_size: int,
    mixed_precision: str = "no",
    cpu_offload: bool = False,
    shard_size: int = 0,
) -> nn.Module:
    """Shard `module` in place over all ranks (the half's `shard_units`, then the root); returns it.

    `cpu_offload` keeps the shards in host memory and copies them to `device` for each forward (FSDP2's
    `CPUOffloadPolicy`; used for the frozen KL reference of a full fine-tune). `shard_size` (0 = all ranks)
    shards over groups of that many ranks and replicates across the groups (HSDP): the all-gathers stay
    inside a group (a node's NVLink), and only the gradients cross groups (one all-reduce per step).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": _mesh(device.type, world_size, shard_size),
        "mp_policy": mixed_precision_policy(mixed_precision),
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # FSDP2 warns when a unit returns a view (the DiT's output is a reshape): an in-place op on it would skip
    # the gradient all-gather. The rollout and loss math use out-of-place ops only, and tests/test_fsdp.py
    # checks the sharded gradients against DDP's.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # Units free their gathered weights after forward; the root keeps its own (backward starts with it),
    # which is FSDP2's default, spelt out because `gathered` restores it.
    for unit in model_half(component).shard_units(module):
        fully_shard(unit, reshard_after_forward=True, **kwargs)
    fully_shard(module, reshard_after_forward=False, **kwargs)
    # transformers' generate() then runs with synced_gpus: no rank stops stepping before the others.
    module._is_fsdp_managed_module = True
    return module


@contextlib.contextmanager
def gathered(module: nn.Module, component: str):
    """Every unit of a sharded `module` that runs gathered once, kept for the block, then sharded again.

    For sampling (rollouts, evaluation), where a forward per denoising step or per generated token would
    otherwise all-gather every unit each time (TRL gathers ZeRO-3 weights for generation the same way,
    `ds3_gather_for_generation`). The gathered weights are the same values the per-unit gathers give (in
    the policy's compute dtype), so the numbers do not change; the cost is one full copy of the component
    per rank while the block runs (the AR model's unused image towers stay sharded). Inside it forwards
    make no collective.
    """
    from torch.distributed.fsdp import FSDPModule

    unused = {id(unit) for unit in model_half(component).unused_units(module)}
    units = [m for m in module.modules() if isinstance(m, FSDPModule) and id(m) not in unused]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield module
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not module, recurse=False)  # as `shard` set them


def reshard_all(module: nn.Module) -> None:
    """Every FSDP unit of `module` back to its shards, so its parameters are the sharded ones again (a unit
    kept gathered after a forward, as the root is, would otherwise run on its gathered copy)."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a sharded tensor (DTensor): the whole tensor on every rank; another one as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def copy_full_into_(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole tensor into `target`: into this rank's shard when `target` is sharded (no communication:
    every rank has `value`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        value = distribute_tensor(
            value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
    target.copy_(value.to(target.device, target.dtype))


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip sharded gradients by their global 2-norm (the norm of the full gradient, same on every rank)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the shards' partial norms, reduced over the ranks
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def gathered_trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full trainable parameters, on CPU, on rank 0 ({} elsewhere), named as unsharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options(cpu_offload=True, ignore_frozen_params=True))
    return {name: value.contiguous() for name, value in state.items()}


def load_gathered_trainable_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: rank 0's full trainable parameters (`state`; {} elsewhere) into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_options(broadcast_from_rank0=True, strict=False))


def gathered_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the full optimizer state keyed by parameter name, on CPU, on rank 0 ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))


def load_gathered_optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Collective: rank 0's full optimizer state (`state`; {} elsewhere) into every rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=_options(broadcast_from_rank0=True))

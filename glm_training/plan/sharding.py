"""FSDP in the plan: how many shards the trained half is cut into, and what a rank gathers back.

Under `trainer.strategy=fsdp` the trained component's parameters, gradients and optimizer state are divided
by the shard count; one shard unit (one DiT block / one GLM decoder layer) is gathered at a time (two with
prefetching), which the plan adds back. Frozen components are replicated on every rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from glm_training.models.halves import ModelHalf
from glm_training.plan.components import DTYPE_BYTES, numel
from glm_training.plan.report import Term


def shard_count(cfg: Any, world_size: int, strategy: str) -> int:
    """Under FSDP each rank holds 1/shard of the trained half: 1/world, or 1/fsdp_shard_size under HSDP;
    1 otherwise."""
    return (cfg.trainer.fsdp_shard_size or world_size) if strategy == "fsdp" and world_size > 1 else 1


def gathered_units(cfg: Any, trained: nn.Module, half: ModelHalf) -> tuple[Term, float]:
    """The FSDP units a sharded rank holds gathered during the update, and the bytes a sampling gather
    (`trainer.fsdp_gather_for_rollout`) adds on top of them (0.0 without it)."""
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    layers = half.layers(trained)
    # One unit gathered for compute and the next one prefetched (FSDP2's default), plus the root unit
    # (everything outside the half's `shard_units`: embeddings, heads), gathered for the whole forward;
    # in the policy's compute dtype (bf16 under trainer.mixed_precision=bf16).
    unit = numel(layers[0]) if len(layers) else 0
    root = numel(trained) - sum(numel(u) for u in half.shard_units(trained))
    gathered = min(2, len(layers))
    gbytes = DTYPE_BYTES["bfloat16"] if cfg.trainer.mixed_precision == "bf16" else wbytes
    units_bytes = (gathered * unit + root) * gbytes
    term = Term(
        "FSDP gathered units",
        units_bytes,
        f"{gathered} layer(s) (one computing, one prefetched) + the root unit",
    )
    rollout_gather = 0.0
    if cfg.trainer.fsdp_gather_for_rollout:
        # Sampling gathers the component once (`gathered` in `distributed/sharding.py`; not the AR model's
        # unused image towers), in place of the units above.
        unused = sum(numel(u) for u in half.unused_units(trained))
        rollout_gather = (numel(trained) - unused) * gbytes - units_bytes
    return term, rollout_gather

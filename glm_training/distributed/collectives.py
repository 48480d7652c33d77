"""Everything distributed, in one place: rank info, device choice, the accelerate engine, and collectives.

Trainers never call `torch.distributed` themselves. Every helper runs with the gloo backend on CPU, so the
multi-rank behaviour is tested for real with 2 processes under `torchrun` (and `accelerate launch
--multi_gpu`, torchrun underneath) on one machine, and degrades to a no-op in a single process.

Two rules from the project's seed bugs live here:
- distributed is detected from the environment (`WORLD_SIZE != 1`, `RANK`, `LOCAL_RANK`) or from the
  configured engine (FSDP, DeepSpeed), and decides how models are loaded (see `models/placement.py`);
- objects sent between ranks travel as CPU tensors, and whatever a rank receives is moved to its own
  device before use (`gather_objects`): `all_gather_object` unpickles a CUDA tensor onto the device it
  left from, so without this a rank ends up stacking another rank's `cuda:3` tensor with its own `cuda:2`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from glm_training.errors import UserError

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int


class LaunchError(UserError, RuntimeError):
    """The launcher started fewer processes than asked for; the message gives the command that works."""


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """Rank, local rank and world size as torchrun (or any launcher following its convention) sets them.

    `accelerate launch --multi_gpu` (and on GPU machines plain `accelerate launch --num_processes N`) runs
    torchrun underneath, so it sets the same variables. On a machine without GPUs, `accelerate launch
    --num_processes N` without `--multi_gpu` starts ONE process (its multi-CPU mode needs mpirun); that
    process would silently train alone, so it is refused here with the command that works.
    """
    env = os.environ if env is None else env
    if _single_process_accelerate_launch(env):
        raise LaunchError(
            "`accelerate launch` started this script as one process although more were asked for: unless "
            "the machine has several GPUs it starts several processes only with --multi_gpu (torchrun "
            "underneath; gloo on CPU). Run `accelerate launch --multi_gpu --num_processes N SCRIPT ...` or "
            "`torchrun --nproc_per_node=N SCRIPT ...`."
        )
    return RankInfo(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
    )


def _single_process_accelerate_launch(env: Mapping[str, str]) -> bool:
    """accelerate's simple launcher with `--num_processes > 1`: it sets MASTER_ADDR for the world it did not
    start (and its ACCELERATE_* variables) but neither WORLD_SIZE nor, without mpirun, any MPI variable."""
    launched_by_accelerate = "ACCELERATE_DYNAMO_BACKEND" in env and "ACCELERATE_MIXED_PRECISION" in env
    world_vars = ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
    return launched_by_accelerate and "MASTER_ADDR" in env and not any(v in env for v in world_vars)


def detect_distributed(env: Mapping[str, str] | None = None, strategy: str = "ddp") -> tuple[bool, str]:
    """Whether this process is part of a distributed run, and why (for the log line).

    Any of `WORLD_SIZE != 1`, `RANK` or `LOCAL_RANK` in the environment, or an engine that shards the model
    (FSDP, DeepSpeed, even on one process), counts: each means the model must not be loaded with a
    multi-device map.
    """
    env = os.environ if env is None else env
    if env.get("WORLD_SIZE", "1") != "1":
        return True, f"WORLD_SIZE={env['WORLD_SIZE']}"
    for var in ("RANK", "LOCAL_RANK"):
        if var in env:
            return True, f"{var}={env[var]} is set"
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):  # an accelerate config's engine
        return True, "DeepSpeed is enabled"
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") or strategy == "fsdp":
        return True, "FSDP is enabled"
    return False, "no distributed environment variables"


def choose_device(local_rank: int = 0) -> torch.device:
    """`cuda:<local_rank>` when CUDA is present, else the CPU. Resolved once at start-up and passed down."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Device equality that treats `cpu` and `cpu:0` (what accelerate reports under gloo) as one device."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return (a.index or 0) == (b.index or 0)


def make_accelerator(
    *,
    mixed_precision: str = "no",
    timeout_s: float = 1800.0,
    seed_everything: int | None = None,
):
    """The accelerate engine (process group, DDP wrapping, autocast); gloo on machines without CUDA.

    `strategy=fsdp` uses the same plain engine: the trainer shards the trainable component with FSDP2
    itself (`sharding.py`, one unit per block, which accelerate's plugin does not choose for GLM-Image)
    and does not let accelerate wrap it.

    `cpu=True` on a CUDA-less machine is what makes accelerate pick its MULTI_CPU/gloo mode under torchrun
    (otherwise it silently runs each rank as an independent single process).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    # accelerate keeps one engine state per process and refuses another precision for a later Accelerator:
    # each trainer (the Python API may build several in one session) sets its own. The process group
    # (accelerate's PartialState) stays.
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=mixed_precision,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout_s))],
    )
    if seed_everything is not None:
        from accelerate.utils import set_seed

        set_seed(seed_everything)
    return accelerator


# ---------------------------------------------------------------------------------------------------------
# Collectives. All are no-ops (identity) in a single process.


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def _comm_device() -> torch.device:
    """Tensors given to a collective must live where the backend expects them (CUDA for NCCL)."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_cat(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equally shaped tensors from every rank along dim 0, in rank order; same device as input."""
    if not is_initialized():
        return tensor
    device = tensor.device
    local = tensor.detach().to(_comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=0).to(device)


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum / max / min of a tensor over ranks (returns a new tensor on the input's device)."""
    if not is_initialized():
        return tensor.clone()
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    device = tensor.device
    out = tensor.detach().to(_comm_device()).clone()
    dist.all_reduce(out, op=ops[op])
    return out.to(device)


def to_device(obj: T, device: torch.device | str) -> T:
    """Recursively move every tensor in nested dicts/lists/tuples to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)  # type: ignore[return-value]
    if isinstance(obj, Mapping):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device) for v in obj))  # type: ignore[return-value]
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)  # type: ignore[return-value]
    return obj


def gather_objects(obj: Any, device: torch.device | str = "cpu") -> list[Any]:
    """Every rank's `obj`, in rank order, with every tensor moved to *this* rank's `device`.

    Tensors are sent as CPU tensors (so unpickling never touches another rank's GPU) and moved to `device`
    on arrival; the caller can stack what it receives without any further `.to()`.
    """
    payload = to_device(obj, "cpu")
    if not is_initialized():
        return [to_device(payload, device)]
    received: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(received, payload)
    return [to_device(item, device) for item in received]


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s object on every rank (e.g. an output folder name chosen from rank 0's clock)."""
    if not is_initialized():
        return obj
    box = [to_device(obj, "cpu")]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def background_group(timeout_s: float) -> Any:
    """Collective: a gloo process group of every rank for work done in a background thread (a checkpoint
    written while training goes on): its collectives never interleave with the training's on the default
    group, and fail after `timeout_s` when a peer is gone (the training's bound), so that a dead rank cannot
    keep this one alive in a write. `False` in a single process (nothing to coordinate)."""
    if not is_initialized():
        return False
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


@contextlib.contextmanager
def one_process_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL on CUDA, gloo elsewhere), so that the collectives above
    run for real in one process (`glm_training.gpu_check`'s gather check); nothing if a group exists."""
    if is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_bounds(total: int, rank: int, num_ranks: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of `total` items; `total` must divide evenly."""
    if total % num_ranks:
        raise ValueError(f"{total} items cannot be split evenly over {num_ranks} ranks.")
    per = total // num_ranks
    return rank * per, (rank + 1) * per


def flatten(nested: Sequence[Sequence[T]]) -> list[T]:
    return [item for part in nested for item in part]


# ---------------------------------------------------------------------------------------------------------
# Failure detection: which phase a rank is in, bounded collectives, and one message naming both.
#
# A rank that dies (its sockets close) makes gloo raise at once in the survivors; one that stalls (SIGSTOP, a
# hung kernel) is caught by the process group's own timeout, which torch enforces in every collective,
# including DDP's gradient all-reduce. This module only adds what torch cannot know: the training step and
# the phase the survivor was in when the collective failed.

PHASES = ("start-up", "rollout", "reward gather", "update", "checkpoint", "evaluation", "shutdown")
_current = {"phase": "start-up", "step": None}


class CollectiveFailure(RuntimeError):
    """Another rank died or stopped answering; the message names this rank, the step and the phase."""


def set_phase(name: str, step: int | None = None) -> None:
    """Mark what this rank is doing from now on (one of `PHASES`; `step` None keeps the current step).

    A plain setter, not a scope: the phase stays until the next one is set, so after a failure (or a kill) it
    is the phase the rank was in, for the message that names it.
    """
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; one of {PHASES}")
    _current.update(phase=name, step=step if step is not None else _current["step"])
    _publish_phase()


def _store():
    """The rendezvous key-value store (torchrun's agent hosts it, so it outlives a dead worker), or None."""
    if not is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


def _publish_phase() -> None:
    """Leave this rank's step and phase in the store, where a survivor can read them after a failure."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"glm_training/phase/{dist.get_rank()}", f"{_current['step']}|{_current['phase']}")
    except (RuntimeError, ValueError):
        pass  # best effort: the store is only read to improve an error message


def peer_phases() -> dict[int, str]:
    """{rank: "step S, phase 'P'"}: where every other rank last said it was (what the store still holds)."""
    store = _store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        key = f"glm_training/phase/{rank}"
        try:
            if rank == dist.get_rank() or not store.check([key]):
                continue
            step, _, name = store.get(key).decode().partition("|")
        except (RuntimeError, ValueError):
            return found
        found[rank] = f"step {step}, phase '{name}'" if step != "None" else f"phase '{name}'"
    return found


def current_phase() -> tuple[str, int | None]:
    return _current["phase"], _current["step"]


def is_collective_failure(err: BaseException) -> bool:
    """A collective that failed because a peer died or timed out (gloo and NCCL raise various types)."""
    if isinstance(err, CollectiveFailure):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        needle in text for needle in ("gloo", "nccl", "connection closed by peer", "timed out waiting")
    )


def describe_failure(err: BaseException, timeout_s: float | None) -> str:
    """One line: this rank, the step and phase it was in, what torch reported, and the bound that applied."""
    name, step = current_phase()
    rank = dist.get_rank() if is_initialized() else int(os.environ.get("RANK", 0))
    where = f"step {step}" if step is not None else "start-up"
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    bound = f" (bound: trainer.dist_timeout_s={timeout_s:g})" if timeout_s else ""
    # A rank still in an earlier step or another phase than this one is the one that died or stalled.
    mine = f"step {step}, phase '{name}'" if step is not None else f"phase '{name}'"
    others = peer_phases()
    behind = {r: where for r, where in others.items() if where != mine}
    peers = "; ".join(f"rank {r} was last in {w}" for r, w in sorted((behind or others).items()))
    return (
        f"rank {rank}: a collective failed at {where}, phase '{name}': another rank died or stopped "
        f"answering{bound}.{' ' + peers + '.' if peers else ''} torch reported: {cause}. If a rank died, "
        "the launcher's summary names it."
    )


def set_collective_timeout(timeout_s: float) -> None:
    """Bound every later collective (ours and DDP's) by `timeout_s`; the process group stays the same.

    The process group starts with the loading bound (rank 0 may download a model while the others wait at a
    barrier); once training runs, a step's collectives should fail within minutes when a peer is gone.
    """
    if not is_initialized():
        return
    try:
        # Private, but the one way to change a live group's timeout (gloo and NCCL alike); torch >= 2.2.
        from torch.distributed.distributed_c10d import _set_pg_timeout
    except ImportError:
        logger.warning("this torch cannot change the process group's timeout; the loading bound stays")
        return
    _set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank: the one point where ranks agree to skip or stop."""
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), op="max").item())

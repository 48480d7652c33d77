"""Checkpoints: trainable weights, optimizer, LR scheduler, EMA, RNG and step, written atomically.

A checkpoint is `<output_dir>/checkpoints/step-000010/`, written into a temporary sibling folder and renamed
into place when complete, so a crash mid-save never leaves a half checkpoint that `resume=latest` would pick
up, and an existing checkpoint is never overwritten. Only the trainable parameters are stored (the LoRA
adapters, or the whole component for full fine-tuning), as safetensors; the frozen rest is reloaded from
`model.name`.

Integrity: `hashes.json` records the SHA-256 of every file. Resume checks them and refuses a checkpoint whose
file changed (bit rot, a copy cut short, a file edited by hand), naming the file; `resume=latest` then
falls back to the newest intact checkpoint. Every `torch.load` uses `weights_only=True`: a checkpoint is
data, and loading one never runs code from its pickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import random
import re
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from glm_training.errors import UserError
from glm_training.models.halves import HALVES

logger = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class CheckpointInfo:
    """What an export needs to know about one checkpoint, read without loading any model."""

    path: Path  # the step folder
    step: int
    component: str  # "dit" or "ar"
    model: Any  # the run's `ModelConfig` (name, tiny_seed, dtype, lora)
    has_ema: bool

    @property
    def pipeline_component(self) -> str:
        """The pipeline attribute that trained: "transformer" or "vision_language_encoder"."""
        return HALVES[self.component].attribute

    @property
    def is_lora(self) -> bool:
        return bool(self.model.lora.enabled)


def resolve_checkpoint(path: Path | str) -> Path:
    """A step folder -> itself; a run folder (or its `checkpoints/`) -> its newest complete checkpoint.

    Raises `CheckpointError` naming what was expected when `path` is neither.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' does not exist or is not a folder; {CHECKPOINT_LAYOUT}.")
    if (path / STATE_FILE).is_file():
        weights = f"{SHARDS_DIR}/.metadata" if (path / SHARDS_DIR).is_dir() else WEIGHTS_FILE
        missing = [name for name in (weights, CONFIG_FILE) if not (path / name).is_file()]
        if missing:
            raise CheckpointError(
                f"'{path}' has {STATE_FILE} but lacks {missing}, so it is not a complete checkpoint; "
                f"{CHECKPOINT_LAYOUT}."
            )
        return path
    run_dir = path.parent if path.name == "checkpoints" else path
    # A step folder renamed from `.tmp` only once complete has a plain numeric suffix; skip anything else.
    found = [p for p in list_checkpoints(run_dir) if p.name[len(CHECKPOINT_PREFIX) :].isdigit()]
    if not found:
        raise CheckpointError(
            f"'{path}' is neither a checkpoint folder (no {STATE_FILE}) nor a run folder holding one; "
            f"{CHECKPOINT_LAYOUT}."
        )
    return found[-1]


def read_checkpoint(path: Path | str) -> CheckpointInfo:
    """Resolve `path` and read its step, component and model settings (no weights, no model)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from glm_training.config import ModelConfig

    step_dir = resolve_checkpoint(path)
    try:
        state = read_checkpoint_state(step_dir)
        step, component = int(state["step"]), str(state["component"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"'{step_dir / STATE_FILE}' is unreadable ({err!r}); it should be "
            '{"step": N, "component": "dit"|"ar"} as the trainers write it.'
        ) from None
    if component not in HALVES:
        raise CheckpointError(
            f"'{step_dir / STATE_FILE}' names component '{component}'; expected one of {sorted(HALVES)}."
        )
    try:
        raw = OmegaConf.load(step_dir / CONFIG_FILE)
        if "model" not in raw:
            raise CheckpointError(
                f"'{step_dir / CONFIG_FILE}' has no 'model' section; was it written by a trainer?"
            )
        # Only the model section matters here; merging it into the schema fills keys older runs lacked.
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
    except CheckpointError:
        raise
    except (ValueError, OmegaConfBaseException) as err:  # ConfigError and yaml's errors are ValueErrors
        raise CheckpointError(f"'{step_dir / CONFIG_FILE}': the model section is unreadable: {err}") from None
    return CheckpointInfo(step_dir, step, component, model, (step_dir / EMA_FILE).is_file())


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(output_dir: Path) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    # Only finished folders: a save cut short leaves `step-NNNNNN.tmp`, which must never be resumed from.
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)]
    return sorted((p for p in found if (p / STATE_FILE).is_file()), key=lambda p: p.name)


def resolve_resume(resume: str, output_dir: Path) -> Path:
    """`"latest"` -> the newest intact checkpoint in `output_dir`; a path -> that checkpoint, checked.

    A checkpoint whose files fail their recorded hashes is refused (`CheckpointError` naming the file); with
    `"latest"` the next older one is tried, with a warning for each one passed over.
    """
    return find_resume(resume, output_dir)[0]


def find_resume(resume: str, output_dir: Path) -> tuple[Path, list[Path]]:
    """`resolve_resume`'s checkpoint, and the damaged ones newer than it that `"latest"` passed over."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"trainer.resume=latest but '{output_dir}/checkpoints' holds no complete checkpoint; set "
                "trainer.output_dir to the run to continue, or drop trainer.resume to start afresh."
            )
        problems, damaged = [], []
        for path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                return path, damaged
            logger.warning("skipping checkpoint %s: %s", path, problem)
            problems.append(f"{path.name}: {problem}")
            damaged.append(path)
        raise CheckpointError(
            f"trainer.resume=latest: no intact checkpoint in '{output_dir}/checkpoints' "
            f"({'; '.join(problems)}); restore the files from a copy, or drop trainer.resume to start afresh."
        )
    path = Path(resume).expanduser()
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"trainer.resume='{resume}' is not a checkpoint folder (no {STATE_FILE}); give a folder such "
            f"as <output_dir>/checkpoints/{CHECKPOINT_PREFIX}000010, or 'latest'."
        )
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(
            f"trainer.resume='{resume}': {problem}; restore it from a copy, or resume from another "
            "checkpoint (trainer.resume=latest skips damaged ones)."
        )
    return path, []


def set_aside(checkpoint: Path) -> Path:
    """Rename a damaged checkpoint to `<name>.damaged` (`.damaged-2`, ... if taken) and log it: kept for
    inspection, never deleted, and no longer a checkpoint (`list_checkpoints`), so that a run resumed from
    an older one writes that step again."""
    target = checkpoint.with_name(f"{checkpoint.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = checkpoint.with_name(f"{checkpoint.name}.damaged-{n}")
    checkpoint.rename(target)
    logger.warning("set the damaged checkpoint %s aside as %s (kept, not deleted)", checkpoint, target.name)
    return target


def later_checkpoints(output_dir: Path, step: int) -> list[Path]:
    """The complete checkpoints in `output_dir` past `step`: a run resumed at `step` writes those again."""
    return [p for p in list_checkpoints(output_dir) if read_checkpoint_state(p)["step"] > step]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_hashes(folder: Path) -> None:
    """Record the SHA-256 of every file in `folder` and its shards folder (before the state file marks it
    complete), by path relative to `folder`."""
    skip = (STATE_FILE, HASHES_FILE)
    names = sorted(
        p.relative_to(folder).as_posix()
        for p in [
            *folder.iterdir(),
            *((folder / SHARDS_DIR).iterdir() if (folder / SHARDS_DIR).is_dir() else []),
        ]
        if p.is_file() and p.name not in skip
    )
    hashes = {name: file_sha256(folder / name) for name in names}
    (folder / HASHES_FILE).write_text(json.dumps(hashes, indent=1), encoding="utf-8")


def verify_checkpoint(path: Path) -> str | None:
    """None if every recorded file is present with its recorded hash; else what is wrong, naming the file."""
    hashes_file = Path(path) / HASHES_FILE
    if not hashes_file.is_file():
        logger.warning("checkpoint %s has no %s (an older version wrote it): not verified", path, HASHES_FILE)
        return None
    try:
        hashes = json.loads(hashes_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return f"'{hashes_file}' is damaged"
    for name, expected in sorted(hashes.items()):
        file = Path(path) / name
        if not file.is_file():
            return f"'{file}' is missing"
        if file_sha256(file) != expected:
            return f"'{file}' does not match its recorded SHA-256 (damaged or changed since it was written)"
    return None


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """A checkpoint's `trainer_state.json`: {"step": N, "component": "dit" | "ar"}."""
    return json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))


def trainable_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (LoRA adapters or the whole component), detached, on CPU, contiguous."""
    return {n: p.detach().cpu().contiguous() for n, p in module.named_parameters() if p.requires_grad}


def check_trainable_names(module: nn.Module, names: set[str]) -> None:
    """Refuse a checkpoint whose parameter names are not exactly the trainable parameters of `module`."""
    expected = {n for n, p in module.named_parameters() if p.requires_grad}
    missing, unexpected = expected - names, names - expected
    if missing or unexpected:
        raise CheckpointError(
            "checkpoint does not match the model being trained: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}. Was it written with other "
            "model.lora settings or another model.name?"
        )


def load_trainable_state_dict(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    check_trainable_names(module, set(state))
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].device, params[name].dtype))


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

    `background_group` (`distributed.background_group()`; `False` in one process): DCP's `async_save`, which
    copies this rank's part to host memory, returns, and writes it from a thread, coordinating over that
    group (not the training's, whose collectives go on meanwhile). Returns the write's future, or None when
    the write is done.
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


def rng_state() -> dict[str, Any]:
    """Every random stream's state, as tensors and plain numbers only (loadable with `weights_only=True`)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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

    `parallel` (`glm_training.parallel`) writes the weights and optimizer state (`save_state`): gathered to
    rank 0 (`trainable.safetensors`, `optimizer.pt`; under FSDP a collective, the optimizer state keyed by
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
        if final.exists():
            raise CheckpointError(
                f"refusing to overwrite the existing checkpoint {final} (checkpoints are never overwritten); "
                "continue from it with trainer.resume=latest, or move it aside, or write this run to a new "
                "trainer.output_dir."
            )
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
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


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps everything)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


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

    `parallel` (`glm_training.parallel`) loads the weights and optimizer state: under FSDP a collective,
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

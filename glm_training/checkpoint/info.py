"""A checkpoint seen from outside a run (export, evaluation, frozen weights): found from a step or run
folder and verified against its hashes, and its step, component and model settings read without loading
any model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm_training.checkpoint.integrity import newest_intact, verify_checkpoint
from glm_training.checkpoint.layout import (
    CHECKPOINT_LAYOUT,
    CHECKPOINT_PREFIX,
    CONFIG_FILE,
    EMA_FILE,
    SHARDS_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    list_checkpoints,
    read_checkpoint_state,
)
from glm_training.models.halves import HALVES

logger = logging.getLogger("glm_training.checkpoint")


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
    """A step folder -> itself; a run folder (or its `checkpoints/`) -> its newest intact checkpoint (the
    damaged ones after it named in a warning). Either is verified against its hashes
    (`integrity.verify_checkpoint`), so that no reader loads a damaged file.

    Raises `CheckpointError` naming what was expected, or the damaged file, when `path` is neither.
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
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint '{path}': {problem}; restore it from a copy, or give its run folder to use the "
                "newest intact checkpoint."
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
    newest, damaged = newest_intact(found)
    if newest is None:
        problems = "; ".join(problem for _, problem in damaged)
        raise CheckpointError(f"'{path}' holds no intact checkpoint ({problems}); restore one from a copy.")
    if damaged:
        logger.warning("%s: using %s, the newest intact checkpoint", path, newest.name)
    return newest


def read_checkpoint(path: Path | str) -> CheckpointInfo:
    """Resolve `path` and read its step, component and model settings (no weights, no model)."""
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
    model = _read_model_config(step_dir)
    return CheckpointInfo(step_dir, step, component, model, (step_dir / EMA_FILE).is_file())


def _read_model_config(step_dir: Path) -> Any:
    """The `ModelConfig` of the run that wrote the checkpoint, from its `config.yaml`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from glm_training.config import ModelConfig

    try:
        raw = OmegaConf.load(step_dir / CONFIG_FILE)
        if "model" not in raw:
            raise CheckpointError(
                f"'{step_dir / CONFIG_FILE}' has no 'model' section; was it written by a trainer?"
            )
        # Only the model section matters here; merging it into the schema fills keys older runs lacked.
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
    except CheckpointError:
        raise
    except (ValueError, OmegaConfBaseException) as err:  # ConfigError and yaml's errors are ValueErrors
        raise CheckpointError(f"'{step_dir / CONFIG_FILE}': the model section is unreadable: {err}") from None

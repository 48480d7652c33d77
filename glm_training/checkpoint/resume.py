"""Which checkpoint a run continues from, and what becomes of the others.

`resume=latest` takes the newest checkpoint whose files pass their recorded hashes (`integrity.py`),
passing over damaged ones with a warning; a damaged checkpoint is set aside (renamed, never deleted), the
checkpoints past the resumed step are found so they can be written again, and all but the newest
`keep_last` are pruned.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from glm_training.checkpoint.integrity import verify_checkpoint
from glm_training.checkpoint.layout import (
    CHECKPOINT_PREFIX,
    STATE_FILE,
    CheckpointError,
    list_checkpoints,
    read_checkpoint_state,
)

logger = logging.getLogger("glm_training.checkpoint")


def resolve_resume(resume: str, output_dir: Path) -> Path:
    """`"latest"` -> the newest intact checkpoint in `output_dir`; a path -> that checkpoint, checked.

    A checkpoint whose files fail their recorded hashes is refused (`CheckpointError` naming the file); with
    `"latest"` the next older one is tried, with a warning for each one passed over.
    """
    return find_resume(resume, output_dir)[0]


def find_resume(resume: str, output_dir: Path) -> tuple[Path, list[Path]]:
    """`resolve_resume`'s checkpoint, and the damaged ones newer than it that `"latest"` passed over."""
    if resume == "latest":
        return _find_latest(output_dir)
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


def _find_latest(output_dir: Path) -> tuple[Path, list[Path]]:
    """The newest intact checkpoint in `output_dir`, and the damaged ones newer than it."""
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


def prune_checkpoints(output_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps everything)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)

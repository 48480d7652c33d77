"""Which checkpoint a run continues from, and what becomes of the others.

`resume=latest` takes the newest checkpoint whose files pass their recorded hashes (`integrity.py`),
passing over damaged ones with a warning; a damaged checkpoint is set aside (renamed, never deleted), the
checkpoints past the resumed step are found so they can be written again, and all but the newest
`keep_last` are pruned. A run whose halves are checkpointed in folders of their own (a joint run's `ar/` and
`dit/`) resumes from the newest step every half completed (`find_paired_resume`): a stop between the halves'
saves leaves the newer half's checkpoint unpaired, and it is set aside as a damaged one is.
"""

from __future__ import annotations

import difflib
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from glm_training.checkpoint.integrity import newest_intact, verify_checkpoint
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


def check_resume_target(resume: str | None) -> None:
    """Refuse a `trainer.resume` that can be seen to be wrong before anything loads: neither "latest" nor a
    folder that exists (a typo of "latest" is named), a run's folder instead of one of its checkpoints, or a
    folder that is no checkpoint. Its files' hashes are checked when the run resumes (`find_resume`)."""
    if not resume or resume == "latest":
        return
    path = Path(resume).expanduser()
    example = f"<output_dir>/checkpoints/{CHECKPOINT_PREFIX}000010"
    if not path.exists():
        guess = "did you mean 'latest'? " if difflib.get_close_matches(resume, ["latest"], n=1) else ""
        raise CheckpointError(
            f"trainer.resume='{resume}' is neither 'latest' nor a folder that exists; {guess}give a "
            f"checkpoint folder ({example}) or 'latest'."
        )
    if (path / "checkpoints").is_dir():
        raise CheckpointError(
            f"trainer.resume='{resume}' is a run's folder; name one of its checkpoints ({path}/checkpoints/"
            f"{CHECKPOINT_PREFIX}...), or continue that run where it is: trainer.output_dir={resume} "
            "trainer.resume=latest."
        )
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(
            f"trainer.resume='{resume}' is not a checkpoint folder (no {STATE_FILE}); give a folder such as "
            f"{example}, or 'latest'."
        )


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
        raise _no_checkpoint(f"'{output_dir}/checkpoints' holds no complete checkpoint")
    path, damaged = newest_intact(found)
    if path is not None:
        return path, [p for p, _ in damaged]
    problems = "; ".join(f"{p.name}: {problem}" for p, problem in damaged)
    raise CheckpointError(
        f"trainer.resume=latest: no intact checkpoint in '{output_dir}/checkpoints' "
        f"({problems}); restore the files from a copy, or drop trainer.resume to start afresh."
    )


def _no_checkpoint(what: str) -> CheckpointError:
    return CheckpointError(
        f"trainer.resume=latest but {what}; set trainer.output_dir to the run to continue, or drop "
        "trainer.resume to start afresh."
    )


def find_paired_resume(output_dirs: Sequence[Path]) -> tuple[int, list[tuple[Path, str]]]:
    """`resume=latest` for a run whose halves are checkpointed in folders of their own, `output_dirs` (a
    joint run's `ar/` and `dit/`, saved one after the other at the same steps): the newest step of which
    every half holds an intact checkpoint, and the checkpoints past it, each with why it is passed over:
    "damaged" (its files fail their hashes) or "unpaired" (intact, but another half has no intact
    checkpoint of its step: the run stopped between the halves' saves).

    Step 0 (the run's start) when no step is held by every half and none was damaged (a stop between the
    halves' first saves); refused when no half holds a checkpoint, or when damage leaves no step held by all.
    """
    held = [{read_checkpoint_state(p)["step"]: p for p in list_checkpoints(d)} for d in output_dirs]
    if not any(held):
        folders = " nor ".join(f"'{d}/checkpoints'" for d in output_dirs)
        raise _no_checkpoint(f"neither {folders} holds a complete checkpoint")
    passed: list[tuple[Path, str]] = []
    problems = []
    for step in sorted(set().union(*held), reverse=True):
        paths = [h.get(step) for h in held]
        found = {p: verify_checkpoint(p) for p in paths if p is not None}
        if None not in paths and all(problem is None for problem in found.values()):
            return step, passed
        for path, problem in found.items():
            if problem is not None:
                logger.warning("skipping checkpoint %s: %s", path, problem)
                problems.append(problem)
            passed.append((path, "unpaired" if problem is None else "damaged"))
    if problems:
        raise CheckpointError(
            f"trainer.resume=latest: no step has an intact checkpoint of every half ({'; '.join(problems)}); "
            "restore the files from a copy, or drop trainer.resume to start afresh."
        )
    return 0, passed


def set_aside(checkpoint: Path, why: str = "damaged") -> Path:
    """Rename a checkpoint a resume passes over to `<name>.<why>` (`.<why>-2`, ... if taken) and log it:
    kept for inspection, never deleted, and no longer a checkpoint (`list_checkpoints`), so that a run
    resumed from an older one writes that step again. `why`: "damaged" (`find_resume`) or "unpaired"
    (`find_paired_resume`)."""
    target = checkpoint.with_name(f"{checkpoint.name}.{why}")
    n = 1
    while target.exists():
        n += 1
        target = checkpoint.with_name(f"{checkpoint.name}.{why}-{n}")
    checkpoint.rename(target)
    logger.warning("set the %s checkpoint %s aside as %s (kept, not deleted)", why, checkpoint, target.name)
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

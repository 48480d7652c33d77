"""Checkpoint integrity: `hashes.json` records the SHA-256 of every file, and a check against it.

Every reader checks them: resume (`resume.py`), export, evaluation, chained runs' frozen weights
(`info.resolve_checkpoint`). A checkpoint whose file changed (bit rot, a copy cut short, a file edited by
hand) is refused naming the file; given a run folder, a reader takes the newest intact checkpoint
(`newest_intact`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from glm_training.checkpoint.layout import HASHES_FILE, SHARDS_DIR, STATE_FILE

logger = logging.getLogger("glm_training.checkpoint")


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


# Checkpoints found intact in this process, with the size and modification time of each of their files: a
# reader that checks again (export inspects, then loads) does not hash gigabytes twice.
_INTACT: dict[Path, tuple] = {}


def _file_stats(path: Path) -> tuple:
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    return tuple((p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def verify_checkpoint(path: Path) -> str | None:
    """None if every recorded file is present with its recorded hash and the state file (written after the
    hashes) is whole; else what is wrong, naming the file."""
    key = Path(path).resolve()
    if key in _INTACT and _INTACT[key] == _file_stats(key):
        return None
    problem = _verify(Path(path))
    if problem is None:
        _INTACT[key] = _file_stats(key)
    return problem


def _verify(path: Path) -> str | None:
    state_file = Path(path) / STATE_FILE
    try:
        int(json.loads(state_file.read_text(encoding="utf-8"))["step"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"'{state_file}' is damaged (not {{\"step\": N, ...}})"
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


def newest_intact(checkpoints: list[Path]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest of `checkpoints` (oldest first) that passes `verify_checkpoint`, or None; and the newer
    damaged ones with what is wrong with each (logged)."""
    damaged = []
    for path in reversed(checkpoints):
        problem = verify_checkpoint(path)
        if problem is None:
            return path, damaged
        logger.warning("skipping checkpoint %s: %s", path, problem)
        damaged.append((path, problem))
    return None, damaged

"""The results of a run as it goes: each stage timed, logged as it starts and ends, and saved the moment it
ends, so that a run stopped at a time limit keeps every finished stage.

Under `--output`: `gpu_check.jsonl` (one line per finished stage, flushed and synced at once),
`gpu_check.json` (everything so far) and `gpu_check.md` (the tables, `markdown.render_markdown`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
from collections.abc import Iterator
from typing import Any

from glm_training.gpu_check.markdown import render_markdown
from glm_training.gpu_check.measure import free_memory
from glm_training.gpu_check.settings import Settings

logger = logging.getLogger("glm_training.gpu_check")


class Report:
    """The results so far; each stage is timed, logged as it starts and ends, and saved when it ends.

    `gpu_check.jsonl` gets one line a finished stage, flushed and synced to disk at once, so that a run cut
    off at its time limit still leaves every finished stage behind; `gpu_check.json` (everything so far) and
    `gpu_check.md` (the tables) are rewritten after each stage.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        sections = ("stages", "errors", "checks", "pipeline", "decoding", "recipes")
        self.data: dict[str, Any] = {**{name: [] for name in sections}, "training": {}}
        self.started = time.perf_counter()
        settings.output.mkdir(parents=True, exist_ok=True)
        self.lines = settings.output / "gpu_check.jsonl"
        self.lines.write_text("")

    @contextlib.contextmanager
    def stage(self, name: str, section: str, fatal: bool = False) -> Iterator[dict[str, Any]]:
        """Run a stage, yielding the dict its results go in; an exception is recorded (and logged) and the
        run goes on, unless `fatal`."""
        logger.info("[gpu_check] %s ...", name)
        start = time.perf_counter()
        result: dict[str, Any] = {}
        line: dict[str, Any] = {"section": section, "stage": name, "ok": True}
        try:
            yield result
        except Exception as err:  # recorded: the report says which stage failed and why
            line["ok"] = False
            line["error"] = f"{type(err).__name__}: {err}"
            self.data["errors"].append(
                {"stage": name, "error": line["error"], "traceback": traceback.format_exc()[-4000:]}
            )
            logger.error("[gpu_check] %s FAILED: %s: %s", name, type(err).__name__, err)
            free_memory(self.settings.device)
            if fatal:
                raise
        finally:
            line["seconds"] = time.perf_counter() - start
            self.data["stages"].append({"name": name, "seconds": line["seconds"], "ok": line["ok"]})
            if line["ok"]:
                logger.info("[gpu_check] %s done in %.1f s", name, line["seconds"])
            self.append_line({**line, "result": result})
            self.write()

    def append_line(self, line: dict[str, Any]) -> None:
        line["wall_seconds"] = time.perf_counter() - self.started
        with self.lines.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @property
    def passed(self) -> bool:
        return not self.data["errors"] and all(c["passed"] for c in self.data["checks"])

    def write(self) -> None:
        self.data["wall_seconds"] = time.perf_counter() - self.started
        self.data["passed"] = self.passed
        out = self.settings.output
        (out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (out / "gpu_check.md").write_text(render_markdown(self.data))

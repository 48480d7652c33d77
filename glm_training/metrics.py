"""Run outputs a person reads: `metrics.jsonl` (one JSON object per optimizer step) and the progress bar."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("glm_training")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends one line per step to `<output_dir>/metrics.jsonl` on the main process; a no-op elsewhere."""

    def __init__(self, output_dir: Path, enabled: bool):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file reads as one run."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:  # a write cut short (a kill, a full disk)
                logger.warning("%s: line %d is not a whole JSON row; dropped", self.path, number)
                continue
            if row is not None and row.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]

"""Experiment tracking: scalars and captioned sample grids to TensorBoard (default) and/or Weights & Biases.

`build_tracker` returns one `Tracker` per process. Only the main process (rank 0) writes: every other rank
gets a `NullTracker`, which creates no files and imports neither backend. On the main process:

- TensorBoard (`logging.tensorboard`, on by default) writes event files to `<output_dir>/tensorboard/`; view
  them with `tensorboard --logdir <output_dir>/tensorboard`.
- W&B (`logging.wandb`, off by default; `pip install wandb`) logs to `wandb_project`/`wandb_entity` in
  `wandb_mode` "online", "offline" (files only; upload later with
  `wandb sync <output_dir>/wandb/offline-run-*`) or "disabled". Its files go to `<output_dir>/wandb/` and
  are complete once `close()` returns: it finishes the run and stops wandb's service process.

Resuming: the W&B run id is kept in `<output_dir>/wandb/run_id.txt` and the run is opened with
`resume="allow"`, so a run continued in the same output directory (`trainer.resume=latest`) keeps logging into
the same W&B run. W&B drops points whose step is not above the last one it recorded, so steps repeated after
a checkpoint (logged before the interruption) keep their first values there; TensorBoard is opened with
`purge_step` at the resumed step, which discards the events logged after the checkpoint. A fresh output
directory starts a fresh W&B run. A run that ends with an exception is closed as failed (W&B exit code 1).

Values that are not finite real numbers (strings, NaN, inf, multi-element tensors) are skipped with one
warning per key: the full record, including NaNs, is in `metrics.jsonl`. Logging after `close()` is a no-op.
"""

from __future__ import annotations

import abc
import logging
import math
import numbers
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from glm_training.errors import UserError
from glm_training.image_grid import make_image_grid

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
WANDB_RUN_ID_FILE = "run_id.txt"


class TrackerError(UserError, RuntimeError):
    """A tracker cannot start (wandb missing, not logged in, ...); the message says how to fix or skip it."""


def _as_float(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not a finite real scalar."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    elif isinstance(value, np.ndarray):
        if value.size != 1:
            return None
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _markdown_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def captions_markdown(captions: list[str]) -> str:
    """A markdown table `| # | caption |` with one row per image, in grid order (row-major)."""
    rows = [f"| {index} | {_markdown_cell(text)} |" for index, text in enumerate(captions)]
    return "\n".join(["| # | caption |", "|---|---|", *rows])


class Tracker(abc.ABC):
    """Where a run's scalars and sample images go. Subclasses write; this class filters and guards `close`."""

    def __init__(self) -> None:
        self._closed = False
        self._warned_keys: set[str] = set()

    @property
    def closed(self) -> bool:
        return self._closed

    def log_scalars(self, step: int, values: dict[str, Any]) -> None:
        """Record `values` (name -> number) at step `step`; skips non-numbers and non-finite values."""
        if self._closed:
            return
        finite: dict[str, float] = {}
        for key, value in values.items():
            number = _as_float(value)
            if number is None:
                if key not in self._warned_keys:
                    self._warned_keys.add(key)
                    logger.warning("tracking: skipping %r = %r (not a finite number)", key, value)
                continue
            finite[key] = number
        if finite:
            self._write_scalars(int(step), finite)

    def log_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None:
        """Record `images` with one caption each (e.g. `image_grid.caption(prompt, reward)`) under `tag`."""
        if self._closed or not images:
            return
        if len(images) != len(captions):
            raise ValueError(
                f"log_images needs one caption per image, got {len(images)} images and "
                f"{len(captions)} captions"
            )
        self._write_images(int(step), tag, list(images), list(captions))

    def close(self, failed: bool = False) -> None:
        """Flush and release the backend (`failed`: the run ended with an error); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._close(failed)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.close(failed=exc_type is not None)

    @abc.abstractmethod
    def _write_scalars(self, step: int, values: dict[str, float]) -> None: ...

    @abc.abstractmethod
    def _write_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None: ...

    @abc.abstractmethod
    def _close(self, failed: bool) -> None: ...


class NullTracker(Tracker):
    """Records nothing and creates no files: non-main ranks, or both backends switched off."""

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def _write_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None:
        pass

    def _close(self, failed: bool) -> None:
        pass


class TensorBoardTracker(Tracker):
    """TensorBoard event files in `log_dir`: a scalar series per key; images as a captioned grid + text."""

    def __init__(self, log_dir: str | Path, purge_step: int | None = None) -> None:
        super().__init__()
        # Imported here so that ranks without a tracker never load tensorboard.
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        # On resume, events at steps >= purge_step (logged after the checkpoint) are discarded.
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)

    def _write_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None:
        grid_hwc = np.asarray(make_image_grid(images, captions), dtype=np.uint8)
        self._writer.add_image(tag, grid_hwc, global_step=step, dataformats="HWC")
        # Captions in the grid are cut to a few lines; the text tab keeps the full prompts.
        self._writer.add_text(f"{tag}/captions", captions_markdown(captions), global_step=step)

    def _close(self, failed: bool) -> None:
        self._writer.flush()
        self._writer.close()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise TrackerError(
            "logging.wandb=true needs the wandb package: `pip install wandb` (or the project's `wandb` "
            "extra), or set logging.wandb=false to log to TensorBoard only"
        ) from err
    return wandb


class WandbTracker(Tracker):
    """One Weights & Biases run: scalars with `run.log(values, step=step)`, images as a list under `tag`."""

    def __init__(
        self,
        *,
        project: str,
        entity: str | None,
        mode: str,
        run_name: str,
        config: dict[str, Any],
        dir: str | Path,
        run_id: str | None = None,
    ) -> None:
        super().__init__()
        if mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {mode!r}; use 'offline' "
                "on machines without network access and sync later with `wandb sync`"
            )
        wandb = _import_wandb()
        self._wandb = wandb
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=project,
                entity=entity,
                mode=mode,
                name=run_name,
                config=config,
                dir=str(self.dir),
                id=run_id,
                resume="allow" if run_id is not None else None,
            )
        except (wandb.errors.UsageError, wandb.errors.CommError) as err:
            raise TrackerError(
                f"could not start the W&B run ({err}); log in with `wandb login` or set WANDB_API_KEY, or "
                "set logging.wandb_mode=offline (sync later) or logging.wandb=false"
            ) from err

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def _write_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None:
        media = [self._wandb.Image(image, caption=text) for image, text in zip(images, captions, strict=True)]
        self._run.log({tag: media}, step=step)

    def _close(self, failed: bool) -> None:
        """Finish the run, then stop wandb's service process, which writes and closes the run's files.

        finish() returns once the service has the run's last records (uploaded, online), but the service
        writes the `.wandb` file out and closes it only afterwards, when it closes the run; teardown()
        returns once the service process has exited, so the run's files are complete. A later run in this
        process starts a new service.
        """
        try:
            self._run.finish(exit_code=1 if failed else 0)
        finally:
            self._wandb.teardown()


class MultiTracker(Tracker):
    """Sends everything to each of `trackers`; `close` closes all of them even if one fails."""

    def __init__(self, trackers: list[Tracker]) -> None:
        super().__init__()
        self.trackers = list(trackers)

    def _write_scalars(self, step: int, values: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.log_scalars(step, values)

    def _write_images(self, step: int, tag: str, images: list[Image.Image], captions: list[str]) -> None:
        for tracker in self.trackers:
            tracker.log_images(step, tag, images, captions)

    def _close(self, failed: bool) -> None:
        errors: list[BaseException] = []
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as err:  # the other backends must still flush
                errors.append(err)
        if errors:
            raise errors[0]


def _wandb_run_id(wandb_dir: Path) -> str:
    """The run id kept in `wandb_dir`, created on the first start of a run in this output directory."""
    path = wandb_dir / WANDB_RUN_ID_FILE
    if path.is_file():
        run_id = path.read_text(encoding="utf-8").strip()
        if run_id:
            return run_id
    run_id = uuid.uuid4().hex[:16]
    wandb_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


def build_tracker(
    *,
    is_main: bool,
    output_dir: Path,
    run_name: str,
    config: dict[str, Any],
    tensorboard: bool = True,
    wandb: bool = False,
    wandb_project: str = "glm-training",
    wandb_entity: str | None = None,
    wandb_mode: str = "online",
    start_step: int = 0,
) -> Tracker:
    """The tracker of this process: a `NullTracker` off the main process, else the enabled backends.

    `start_step`: the step a resumed run continues from (0 for a fresh run).
    """
    if not is_main:
        return NullTracker()
    output_dir = Path(output_dir)
    if wandb:  # configuration errors before any file is written
        if wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb_mode must be one of {', '.join(WANDB_MODES)}, got {wandb_mode!r}"
            )
        _import_wandb()
    trackers: list[Tracker] = []
    if tensorboard:
        purge_step = start_step + 1 if start_step else None  # a resumed run logs from start_step + 1
        trackers.append(TensorBoardTracker(output_dir / "tensorboard", purge_step=purge_step))
    if wandb:
        try:
            trackers.append(
                WandbTracker(
                    project=wandb_project,
                    entity=wandb_entity,
                    mode=wandb_mode,
                    run_name=run_name,
                    config=config,
                    # wandb writes into `<dir>/wandb/`, next to the run id file.
                    dir=output_dir,
                    run_id=None if wandb_mode == "disabled" else _wandb_run_id(output_dir / "wandb"),
                )
            )
        except BaseException:
            for tracker in trackers:
                tracker.close()
            raise
    if not trackers:
        return NullTracker()
    if len(trackers) == 1:
        return trackers[0]
    return MultiTracker(trackers)

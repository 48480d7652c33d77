"""Logging set-up shared by the trainers and the standalone tools: rank 0 at INFO, the others quieter."""

from __future__ import annotations

import logging
import sys


def setup_logging(is_main: bool) -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors."""
    level = logging.INFO if is_main else logging.WARNING
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("glm_training").setLevel(level)
    processing = logging.getLogger("transformers.processing_utils")
    if not any(isinstance(f, _ProcessorKwargsFilter) for f in processing.filters):
        processing.addFilter(_ProcessorKwargsFilter())


class _ProcessorKwargsFilter(logging.Filter):
    """Drops the warning transformers 5 prints on every call of GlmImagePipeline's AR stage.

    diffusers' GlmImagePipeline passes its processor arguments the pre-5.0 way; the warning is about the
    library's own call, is not actionable by users and would otherwise fill the log once per sample batch.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "processor_kwargs" not in record.getMessage()

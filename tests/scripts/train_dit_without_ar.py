"""`train_dit.py` in a process where constructing the AR model raises (tests/test_priors.py).

Whatever builds a `GlmImageForConditionalGeneration` (diffusers' loader, `from_pretrained`, a direct call)
goes through its `__init__`, so a run that finishes here never instantiated the AR model.
"""

from __future__ import annotations

import sys

import transformers


def _refuse(self, *args, **kwargs):
    raise RuntimeError("GlmImageForConditionalGeneration constructed in a run that must not load it")


transformers.GlmImageForConditionalGeneration.__init__ = _refuse

from glm_training.cli import run  # noqa: E402
from glm_training.engine.trainer import DiTTrainer  # noqa: E402

if __name__ == "__main__":
    sys.exit(run(DiTTrainer, "t2i_training"))

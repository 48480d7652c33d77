"""A user reward (`path.py:function`) whose groups have a tiny but non-zero spread on one rank only.

For the 2-rank `algo.min_group_std` test: on rank 0 the score is the JPEG size in kB (groups spread by
~0.1-1), on rank 1 it is that size times 1e-6 (spread ~1e-7-1e-6: never an exact tie, but far below any
sensible threshold), as a continuous reward whose differences are pure noise would be.
"""

from __future__ import annotations

import os

from glm_training.rewards.jpeg import jpeg_size_kb

TINY_SCALE = 1e-6


def jpeg_size_tiny_on_rank1(images, prompts, metadata):
    scale = TINY_SCALE if os.environ.get("RANK") == "1" else 1.0
    return [scale * jpeg_size_kb(image) for image in images]

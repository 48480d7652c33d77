"""A user reward (`path.py:function`) whose groups have a tiny but non-zero spread on one rank only.

For the 2-rank `algo.min_group_std` test: on rank 0 the score is the JPEG size in kB (groups spread by
~0.01-1), on rank 1 it is that score times 1e-6 (spread ~1e-8-1e-6: never an exact tie, but far below any
sensible threshold), as a continuous reward whose differences are pure noise would be. Two samples of the
tiny model can encode to the same number of bytes, so each sample's position in the batch adds 0.01 kB:
no group ties exactly on either rank.
"""

from __future__ import annotations

import os

from glm_training.rewards.jpeg import jpeg_size_kb

TINY_SCALE = 1e-6


def jpeg_size_tiny_on_rank1(images, prompts, metadata):
    scale = TINY_SCALE if os.environ.get("RANK") == "1" else 1.0
    return [scale * (jpeg_size_kb(image) + 0.01 * i) for i, image in enumerate(images)]

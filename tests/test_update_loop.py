"""The update loop every algorithm shares (`engine/update.py`): its last-backward rule and its contract.

The loop itself runs in every training test; `test_dit_rollout.py` reads its per-optimizer-step statistics
(`trainer.updates.last.mini_batches`), and the DDP / FSDP tests check the gradients it accumulates.
"""

from __future__ import annotations

import pytest

from glm_training.algorithms.base import Algorithm
from glm_training.engine.update import split_mini_batches, with_last


def test_with_last_marks_only_the_last_item():
    assert list(with_last([])) == []
    assert list(with_last(["a"])) == [("a", True)]
    assert list(with_last(iter("abc"))) == [("a", False), ("b", False), ("c", True)]


def test_with_last_reads_one_item_ahead_of_its_consumer():
    # A micro-step generator may prepare the next backward (e.g. draw its noise) before the current one
    # runs; the loop never reads further than one item ahead.
    produced = []

    def items():
        for i in range(4):
            produced.append(i)
            yield i

    for item, _ in with_last(items()):
        assert produced[-1] <= item + 1


def test_mini_batches_interleave_and_none_is_empty():
    assert split_mini_batches(5, 2) == [[0, 2, 4], [1, 3]]
    assert split_mini_batches(1, 2) == [[0]]


def test_a_trainer_without_its_rollout_and_update_cannot_be_built():
    class Incomplete(Algorithm):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(cfg=None, parts=None)

"""HSDP (`trainer.fsdp_shard_size`): shard within groups of ranks, replicate across them, against flat FSDP.

One 4-process launch (gloo, CPU) runs the same DiT full fine-tune with a KL term twice: sharded over all 4
ranks, and as 2 replicas x 2 shards (the mesh two nodes of two GPUs would use). Each rank must hold 1/4 of
the trained weights in the first, 1/2 in the second, and the trained weights must agree within fp32
rounding (the gradients are summed in another order: a reduce-scatter inside each group, then an
all-reduce across the groups).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DIT_SMALL, REPO, torchrun
from safetensors.torch import load_file

from glm_training.metrics import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = [
    *DIT_SMALL,
    "data.num_groups_per_step=4",
    "data.num_generations=2",  # 8 samples: 2 a rank
    "sampling.micro_batch_size=1",
    "algo.num_mini_batches=1",
    "trainer.num_steps=2",
    "trainer.save_every=0",
    "algo.beta=0.04",
    "model.lora.enabled=false",
    "optim.lr=1e-3",
    "trainer.strategy=fsdp",
    "logging.tensorboard=false",
]


def test_hsdp_two_by_two_trains_like_flat_fsdp_over_four_ranks(tmp_path):
    runs = {
        "flat": [*BASE, f"trainer.output_dir={tmp_path / 'flat'}"],
        "hsdp": [*BASE, "trainer.fsdp_shard_size=2", f"trainer.output_dir={tmp_path / 'hsdp'}"],
        "odd!error": [*BASE, "trainer.fsdp_shard_size=3", f"trainer.output_dir={tmp_path / 'odd'}"],
    }
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    result = torchrun(script, [str(tmp_path), "dit", json.dumps(runs)], nproc=4, timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rep in reports:
        total = rep["flat"]["total"]
        assert rep["flat"]["sharded"] and rep["hsdp"]["sharded"]
        assert rep["flat"]["local"] == pytest.approx(total / 4, rel=0.05)
        assert rep["hsdp"]["local"] == pytest.approx(total / 2, rel=0.05)
        assert "trainer.fsdp_shard_size" in rep["odd!error"]["error"]
    final = "checkpoints/step-000002/trainable.safetensors"
    flat, hsdp = (load_file(str(tmp_path / name / final)) for name in ("flat", "hsdp"))
    assert flat.keys() == hsdp.keys() and flat
    for name in flat:
        torch.testing.assert_close(hsdp[name], flat[name], atol=1e-5, rtol=0)
    rows_flat, rows_hsdp = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("flat", "hsdp"))
    assert rows_flat[0]["ratio_mean"] == rows_hsdp[0]["ratio_mean"] == 1.0
    # Step 1 samples with the same weights: the same rewards to the bit. Step 2 samples with weights that
    # differ by the order of the gradient sums (atol 1e-5 above), and the JPEG reward counts an image's bytes
    # (-bytes/1000, a mean over 8 samples): a pixel that rounds the other way on some CPU moves it by a few
    # bytes, hence 1e-2 (~10 bytes an image), not float rounding.
    assert rows_flat[0]["reward_mean"] == rows_hsdp[0]["reward_mean"]
    for a, b in zip(rows_flat[1:], rows_hsdp[1:], strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-2)

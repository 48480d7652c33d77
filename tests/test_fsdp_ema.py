"""The EMA of the trained weights (`algo.ema`) under FSDP: each shadow tensor sharded like its parameter.

One 2-rank launch runs a DiT full fine-tune with EMA for 2 steps under ddp and under fsdp, and resumes the
fsdp run from its first checkpoint. The EMA the fsdp run writes (gathered into the same `ema.pt` a DDP run
writes) must equal the DDP run's within fp32 rounding, its evaluation (which samples with the EMA weights)
must score what DDP's does, and the resumed run's EMA must be the uninterrupted one's, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DIT_SMALL, REPO, torchrun

from glm_training.metrics import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ARGS = [
    *DIT_SMALL,
    "trainer.num_steps=2",
    "trainer.save_every=1",
    "model.lora.enabled=false",
    "optim.lr=1e-3",
    "algo.ema=true",
    "algo.ema_decay=0.5",
    "eval.every_n_steps=2",
    "eval.num_prompts=2",
    "eval.batch_size=2",
    "logging.tensorboard=false",
]


def _shadows(run, step: int) -> list[torch.Tensor]:
    path = run / "checkpoints" / f"step-{step:06d}" / "ema.pt"
    return torch.load(path, map_location="cpu", weights_only=True)["shadow_params"]


def test_ema_under_fsdp_equals_ddp_and_resumes_exactly(tmp_path):
    runs = {
        "ddp": [*ARGS, "trainer.strategy=ddp", f"trainer.output_dir={tmp_path / 'ddp'}"],
        "fsdp": [*ARGS, "trainer.strategy=fsdp", f"trainer.output_dir={tmp_path / 'fsdp'}"],
        "resumed": [
            *ARGS,
            "trainer.strategy=fsdp",
            f"trainer.output_dir={tmp_path / 'resumed'}",
            f"trainer.resume={tmp_path / 'fsdp' / 'checkpoints' / 'step-000001'}",
        ],
    }
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    result = torchrun(script, [str(tmp_path), "dit", json.dumps(runs)], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(rep["fsdp"]["sharded"] and rep["fsdp"]["local"] < rep["fsdp"]["total"] for rep in reports)
    ddp, fsdp, resumed = (_shadows(tmp_path / name, 2) for name in ("ddp", "fsdp", "resumed"))
    assert len(ddp) == len(fsdp) == len(resumed) > 0
    for a, b, c in zip(ddp, fsdp, resumed):
        assert a.shape == b.shape  # whole tensors in the file, as DDP writes them
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert torch.equal(b, c)
    last = {name: read_metrics(tmp_path / name / "metrics.jsonl")[-1] for name in ("ddp", "fsdp")}
    assert last["fsdp"]["eval/reward_mean"] == pytest.approx(last["ddp"]["eval/reward_mean"], abs=1e-4)

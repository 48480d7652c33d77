"""DiffusionNFT's old model and AWM's EMA anchor under FSDP: sharded like the parameters, equal to DDP.

One 2-rank launch trains, 2 steps each, DiffusionNFT as a full fine-tune (the old model: a frozen copy of the
module under DDP, shards copied in and out under FSDP) and AWM with LoRA and both of its KL terms (the anchor:
a second copy of the adapters), each under ddp and fsdp, and resumes the fsdp NFT run from its first
checkpoint. The trained weights and the old model / anchor files (written whole, as DDP writes them) must
equal DDP's within fp32 rounding, and the resumed run's must be the uninterrupted one's, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DIT_SMALL, REPO, torchrun
from safetensors.torch import load_file

from glm_training.metrics import read_metrics
from glm_training.trainers.awm_trainer import ANCHOR_FILE
from glm_training.trainers.nft_trainer import OLD_POLICY_FILE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = [*DIT_SMALL, "trainer.num_steps=2", "trainer.save_every=1", "logging.tensorboard=false"]
NFT = ["--config-name", "nft_training", *COMMON, "model.lora.enabled=false", "optim.lr=1e-3"]
AWM = [
    "--config-name",
    "awm_training",
    *COMMON,
    "model.lora.enabled=true",
    "model.lora.target_modules=[to_q,to_v]",
    "algo.beta=0.003",
    "algo.ema_beta=1.0",
    "algo.train_timesteps=2",
    "optim.lr=1e-3",
]
EXTRA_FILES = {"nft": OLD_POLICY_FILE, "awm": ANCHOR_FILE}


def _final(run, name: str) -> tuple[dict, dict]:
    folder = run / "checkpoints" / "step-000002"
    weights = load_file(str(folder / "trainable.safetensors"))
    return weights, torch.load(folder / name, map_location="cpu", weights_only=True)


def test_nft_and_awm_policy_copies_under_fsdp_equal_ddp(tmp_path):
    runs = {}
    for algo, args in (("nft", NFT), ("awm", AWM)):
        for strategy in ("ddp", "fsdp"):
            out = tmp_path / f"{algo}_{strategy}"
            runs[f"{algo}_{strategy}"] = [*args, f"trainer.strategy={strategy}", f"trainer.output_dir={out}"]
    runs["nft_resumed"] = [
        *NFT,
        "trainer.strategy=fsdp",
        f"trainer.output_dir={tmp_path / 'nft_resumed'}",
        f"trainer.resume={tmp_path / 'nft_fsdp' / 'checkpoints' / 'step-000001'}",
    ]
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    result = torchrun(script, [str(tmp_path), "dit", json.dumps(runs)], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for algo in ("nft", "awm"):
        fsdp = [rep[f"{algo}_fsdp"] for rep in reports]
        assert all(r["sharded"] and r["local"] < r["total"] for r in fsdp)
        (w_ddp, copy_ddp), (w_fsdp, copy_fsdp) = (
            _final(tmp_path / f"{algo}_{s}", EXTRA_FILES[algo]) for s in ("ddp", "fsdp")
        )
        assert w_ddp.keys() == w_fsdp.keys() == copy_ddp.keys() == copy_fsdp.keys() and w_ddp
        for name in w_ddp:
            torch.testing.assert_close(w_fsdp[name], w_ddp[name], atol=1e-5, rtol=0)
            assert copy_fsdp[name].shape == copy_ddp[name].shape  # whole tensors, as DDP writes them
            torch.testing.assert_close(copy_fsdp[name], copy_ddp[name], atol=1e-5, rtol=0)
        # The copy is an EMA that lags the policy: a copy that followed it would be equal.
        assert any(not torch.equal(copy_fsdp[n], w_fsdp[n]) for n in w_fsdp)
        rows = {s: read_metrics(tmp_path / f"{algo}_{s}" / "metrics.jsonl") for s in ("ddp", "fsdp")}
        for a, b in zip(rows["ddp"], rows["fsdp"], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
            assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-4)
    (w_full, old_full), (w_resumed, old_resumed) = (
        _final(tmp_path / name, OLD_POLICY_FILE) for name in ("nft_fsdp", "nft_resumed")
    )
    assert all(torch.equal(w_full[n], w_resumed[n]) for n in w_full)
    assert all(torch.equal(old_full[n], old_resumed[n]) for n in old_full)

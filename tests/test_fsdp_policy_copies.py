"""Copies of the trained weights under FSDP: each sharded like its parameter, written whole as DDP writes it.

One 2-rank launch (a module fixture) trains, 2 steps each:
- a DiT full fine-tune with the evaluation EMA (`algo.ema`) under ddp and under fsdp, and the fsdp run
  resumed from its first checkpoint: the EMA (`ema.pt`) equals DDP's within fp32 rounding, its evaluation
  scores what DDP's does, and the resumed run's EMA is the uninterrupted one's, bit for bit;
- DiffusionNFT as a full fine-tune (the old model: a frozen copy of the module under DDP, shards copied in and
  out under FSDP), AWM with LoRA and both of its KL terms (the anchor: a second copy of the adapters) and
  DGPO as a full fine-tune with its KL (a frozen base model and the EMA reference, which samples the second
  step; 3 groups of 4 on 2 ranks, so one group's sums span both), each under ddp and fsdp, and the fsdp NFT
  run resumed from its first checkpoint: trained weights and the old model / anchor / EMA reference files
  equal DDP's within fp32 rounding, the resumed run's bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DIT_SMALL, REPO, rank_tails, torchrun
from safetensors.torch import load_file

from glm_training.algorithms.awm.algorithm import ANCHOR_FILE
from glm_training.algorithms.dgpo.algorithm import EMA_REF_FILE
from glm_training.algorithms.nft.algorithm import OLD_POLICY_FILE
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
DGPO = [
    "--config-name",
    "dgpo_training",
    *[a for a in COMMON if not a.startswith(("data.num_generations=", "data.num_groups_per_step="))],
    "data.num_generations=4",
    "data.num_groups_per_step=3",
    "model.lora.enabled=false",
    "algo.beta=0.02",
    "algo.trunc_steps=2",
    "algo.train_timesteps=2",
    "algo.switch_ema_ref=0",
    "optim.lr=1e-3",
]
# A joint run (train_joint.py): 3 prompts x 2 priors x 2 renderings, so an AR group straddles the ranks;
# DAPO's filter decides on every rank's groups.
JOINT = [
    "--config-name",
    "joint_training",
    "trainer.progress_bar=false",
    "eval.every_n_steps=0",
    "trainer.save_every=1",
    "ar.sampling.height=64",
    "ar.sampling.width=64",
    "dit.sampling.height=64",
    "dit.sampling.width=64",
    "dit.sampling.num_steps=3",
    "data.num_groups_per_step=3",
    "data.num_priors=2",
    "data.renderings_per_prior=2",
    "ar.algo.dynamic_sampling=true",
    "ar.algo.max_resample_rounds=0",
]
EXTRA_FILES = {"nft": OLD_POLICY_FILE, "awm": ANCHOR_FILE, "dgpo": EMA_REF_FILE}


def _final(run, name: str) -> tuple[dict, dict]:
    folder = run / "checkpoints" / "step-000002"
    weights = load_file(str(folder / "trainable.safetensors"))
    return weights, torch.load(folder / name, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """(output folder, each rank's report) of the one launch."""
    tmp_path = tmp_path_factory.mktemp("fsdp_copies")
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
    for algo, args in (("nft", NFT), ("awm", AWM), ("dgpo", DGPO)):
        for strategy in ("ddp", "fsdp"):
            out = tmp_path / f"{algo}_{strategy}"
            runs[f"{algo}_{strategy}"] = [*args, f"trainer.strategy={strategy}", f"trainer.output_dir={out}"]
    runs["joint_ddp"] = [
        *JOINT,
        "trainer.strategy=ddp",
        "trainer.num_steps=2",
        f"trainer.output_dir={tmp_path / 'joint_ddp'}",
    ]
    joint_fsdp = [*JOINT, "trainer.strategy=fsdp", f"trainer.output_dir={tmp_path / 'joint_fsdp'}"]
    runs["joint_fsdp"] = [*joint_fsdp, "trainer.num_steps=1"]
    runs["joint_fsdp_resumed"] = [*joint_fsdp, "trainer.num_steps=2", "trainer.resume=latest"]
    runs["nft_resumed"] = [
        *NFT,
        "trainer.strategy=fsdp",
        f"trainer.output_dir={tmp_path / 'nft_resumed'}",
        f"trainer.resume={tmp_path / 'nft_fsdp' / 'checkpoints' / 'step-000001'}",
    ]
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    logs = tmp_path / "logs"
    result = torchrun(script, [str(tmp_path), "dit", json.dumps(runs)], timeout=600, log_dir=logs)
    assert result.returncode == 0, f"{rank_tails(logs)}\n--- launcher ---\n{result.stderr[-3000:]}"
    return tmp_path, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ema_under_fsdp_equals_ddp_and_resumes_exactly(launch):
    tmp_path, reports = launch
    assert all(rep["fsdp"]["sharded"] and rep["fsdp"]["local"] < rep["fsdp"]["total"] for rep in reports)
    ddp, fsdp, resumed = (_shadows(tmp_path / name, 2) for name in ("ddp", "fsdp", "resumed"))
    assert len(ddp) == len(fsdp) == len(resumed) > 0
    for a, b, c in zip(ddp, fsdp, resumed):
        assert a.shape == b.shape  # whole tensors in the file, as DDP writes them
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert torch.equal(b, c)
    last = {name: read_metrics(tmp_path / name / "metrics.jsonl")[-1] for name in ("ddp", "fsdp")}
    # The EMA weights differ by the order of the gradient sums (atol 1e-5 above), and the JPEG reward counts
    # an image's bytes (-bytes/1000, a mean over 2 prompts): a pixel that rounds the other way on some CPU
    # moves it by a few bytes, hence 1e-2 (~10 bytes an image), not float rounding.
    assert last["fsdp"]["eval/reward_mean"] == pytest.approx(last["ddp"]["eval/reward_mean"], abs=1e-2)


def _assert_same_run(rows_ddp: list[dict], rows_fsdp: list[dict]) -> None:
    """Step 1 samples with the same weights: the same rewards to the bit, losses within float rounding. Later
    steps sample with weights that differ by the order of the gradient sums (atol 1e-5 above), and the JPEG
    reward counts an image's bytes (-bytes/1000, a mean over 6 samples): a pixel that rounds the other way on
    some CPU moves it by a few bytes, hence 1e-2 (~10 bytes an image); the loss, which the rewards enter
    through the group-standardised advantages, is then compared only where the rewards came out equal."""
    assert rows_ddp[0]["reward_mean"] == rows_fsdp[0]["reward_mean"]
    for a, b in zip(rows_ddp, rows_fsdp, strict=True):
        assert b["reward_mean"] == pytest.approx(a["reward_mean"], abs=1e-2)
        if b["reward_mean"] == a["reward_mean"]:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def test_nft_awm_and_dgpo_policy_copies_under_fsdp_equal_ddp(launch):
    tmp_path, reports = launch
    for algo in ("nft", "awm", "dgpo"):
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
        _assert_same_run(rows["ddp"], rows["fsdp"])
    for strategy in ("ddp", "fsdp"):  # switch_ema_ref=0: the EMA reference samples once a step is done
        rows = read_metrics(tmp_path / f"dgpo_{strategy}" / "metrics.jsonl")
        assert [r["sampled_by_ema_ref"] for r in rows] == [0.0, 1.0]
    (w_full, old_full), (w_resumed, old_resumed) = (
        _final(tmp_path / name, OLD_POLICY_FILE) for name in ("nft_fsdp", "nft_resumed")
    )
    assert all(torch.equal(w_full[n], w_resumed[n]) for n in w_full)
    assert all(torch.equal(old_full[n], old_resumed[n]) for n in old_full)


def test_a_joint_run_under_fsdp_equals_ddp_and_resumes(launch):
    """Both halves sharded (each its own FSDP2 units) train as under DDP, within the other trainers' bound;
    the FSDP run stops after step 1 and resumes from its sharded checkpoints of both halves to step 2."""
    tmp_path, reports = launch
    assert all(rep["joint_fsdp"]["sharded"] == [True, True] for rep in reports)
    assert all(rep["joint_ddp"]["sharded"] == [False, False] for rep in reports)
    for half in ("ar", "dit"):
        ddp, fsdp = (
            load_file(str(tmp_path / run / half / "checkpoints" / "step-000002" / "trainable.safetensors"))
            for run in ("joint_ddp", "joint_fsdp")
        )
        assert ddp.keys() == fsdp.keys() and len(ddp) > 0
        for name in ddp:
            torch.testing.assert_close(fsdp[name], ddp[name], atol=1e-5, rtol=0)
        step1 = load_file(
            str(tmp_path / "joint_ddp" / half / "checkpoints" / "step-000001" / "trainable.safetensors")
        )
        assert any(not torch.equal(step1[n], ddp[n]) for n in ddp), half  # step 2 trained this half

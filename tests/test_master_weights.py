"""Float32 master weights for full fine-tuning of a bf16 model (`model.fp32_master_weights`, issue 23).

At an RL learning rate a bf16 weight trained in place mostly keeps its value; with float32 masters a bf16
load trains like a float32 one, and the first ratio and KL stay exact.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
from conftest import AR_SMALL, DIT_SMALL
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import glm_training.engine.policy as policy_module
from glm_training.cli import run
from glm_training.engine.trainer import ARTrainer, DiTTrainer
from glm_training.export import main as export_main
from glm_training.metrics import read_metrics
from glm_training.models.master_weights import computing_like_masters, upcast_trained_

# 3 steps at an RL learning rate, one optimizer step each, autocast bf16 in every run.
LOW_LR = ["trainer.num_steps=3", "trainer.save_every=0", "optim.lr=1e-5", "trainer.mixed_precision=bf16"]
WITH_KL = ["algo.beta=0.04"]


def _changed_fraction(run_dir, base: dict[str, torch.Tensor]) -> float:
    trained = load_file(str(run_dir / "checkpoints" / "step-000003" / "trainable.safetensors"))
    changed = sum(int((trained[n].float() != base[n]).sum()) for n in trained)
    return changed / sum(t.numel() for t in trained.values())


def _first_row(run_dir) -> dict:
    return read_metrics(run_dir / "metrics.jsonl")[0]


def test_a_bf16_load_trains_like_an_fp32_one_and_exports_bf16(tmp_path, tiny_model_dir):
    fp32_base = load_file(str(next((tiny_model_dir / "transformer").glob("*.safetensors"))))
    bf16_base = {n: t.bfloat16().float() for n, t in fp32_base.items()}
    args = [*DIT_SMALL, *LOW_LR, *WITH_KL, "algo.num_mini_batches=1"]
    runs = {
        "fp32": ["model.dtype=float32"],
        "masters": ["model.dtype=bfloat16"],  # masters are the default
        "bf16": ["model.dtype=bfloat16", "model.fp32_master_weights=false"],
    }
    for name, extra in runs.items():
        assert run(DiTTrainer, "t2i_training", [*args, *extra, f"trainer.output_dir={tmp_path / name}"]) == 0
    fraction = {
        "fp32": _changed_fraction(tmp_path / "fp32", fp32_base),
        "masters": _changed_fraction(tmp_path / "masters", bf16_base),
        "bf16": _changed_fraction(tmp_path / "bf16", bf16_base),
    }
    assert fraction["fp32"] > 0.5
    assert fraction["masters"] >= 0.9 * fraction["fp32"], fraction
    assert fraction["bf16"] < 0.5 * fraction["fp32"], fraction  # what the masters are for
    for name in runs:  # on-policy first step: the ratio is exactly 1 and the KL exactly 0
        row = _first_row(tmp_path / name)
        assert row["ratio_mean"] == 1.0 and row["kl"] == 0.0, (name, row)
    ckpt = tmp_path / "masters" / "checkpoints" / "step-000003"
    with safe_open(str(ckpt / "trainable.safetensors"), "pt") as f:  # the checkpoint keeps the masters
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(ckpt), "--output", str(out)]) == 0
    (exported,) = (out / "transformer").glob("*.safetensors")
    with safe_open(str(exported), "pt") as f:  # export writes the model's dtype
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "export_info.json").read_text())["dtype"] == "bfloat16"


def test_the_ar_reference_computes_with_the_masters_values(tmp_path, monkeypatch):
    args = [*AR_SMALL, *LOW_LR, *WITH_KL, "trainer.num_steps=1", "model.dtype=bfloat16"]
    assert run(ARTrainer, "ar_training", [*args, f"trainer.output_dir={tmp_path / 'masters'}"]) == 0
    row = _first_row(tmp_path / "masters")
    assert row["ratio_mean"] == 1.0 and row["kl"] == 0.0
    # Without it the bf16 reference copy differs from the float32 masters outside autocast (embeddings,
    # norms), and the first KL is not 0: the check above can fail.
    monkeypatch.setattr(
        policy_module, "computing_like_masters", lambda module, names: contextlib.nullcontext()
    )
    assert run(ARTrainer, "ar_training", [*args, f"trainer.output_dir={tmp_path / 'plain'}"]) == 0
    assert _first_row(tmp_path / "plain")["kl"] > 0


def test_computing_like_masters_upcasts_one_submodule_at_a_time_and_restores():
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 2)).bfloat16()
    reference = copy.deepcopy(policy)
    assert upcast_trained_(policy) == sum(p.numel() for p in policy.parameters())
    names = {n for n, _ in policy.named_parameters()}
    tokens = torch.tensor([[1, 2, 3]])
    seen = []
    with torch.no_grad(), computing_like_masters(reference, names):
        # Runs after the context's own pre-hook: layer 1 is restored, layer 2 is upcast.
        reference[2].register_forward_pre_hook(
            lambda m, a: seen.append((reference[1].weight.dtype, m.weight.dtype))
        )
        out = reference(tokens)
    assert seen == [(torch.bfloat16, torch.float32)]
    assert all(p.dtype == torch.bfloat16 for p in reference.parameters())  # restored after the block
    with torch.no_grad():
        assert torch.equal(out, policy(tokens))  # the same values as the masters
    with pytest.raises(IndexError), computing_like_masters(reference, names):
        reference(torch.tensor([[99]]))  # an error inside a submodule's forward
    assert all(p.dtype == torch.bfloat16 for p in reference.parameters())

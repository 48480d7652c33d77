"""Sharded checkpoints (`trainer.checkpoint_format=sharded`, torch.distributed.checkpoint), issue 23.

One 2-rank FSDP launch trains a DiT full fine-tune with a KL term for 2 steps (a checkpoint after each, each
rank writing its own shards), then, in the same process group, resumes from step 1, and trains again with the
first checkpoint written in the background (`trainer.async_save`). Then, in this one process: the resume on 1
rank, export, and damaged shards.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import DIT_SMALL, REPO, torchrun
from safetensors.torch import load_file

from glm_training.checkpoint import (
    SHARDS_DIR,
    CheckpointError,
    read_checkpoint_state,
    read_trained_weights,
    resolve_resume,
    verify_checkpoint,
)
from glm_training.config import ConfigError, load_config
from glm_training.engine.trainer import DiTTrainer
from glm_training.export import main as export_main

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ARGS = [
    *DIT_SMALL,
    "trainer.num_steps=2",
    "trainer.save_every=1",
    "trainer.checkpoint_format=sharded",
    "model.lora.enabled=false",
    "algo.beta=0.04",
    "optim.lr=1e-3",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    fsdp = [*ARGS, "trainer.strategy=fsdp"]
    runs = {
        "full": [*fsdp, f"trainer.output_dir={out / 'full'}"],
        "resumed": [
            *fsdp,
            f"trainer.output_dir={out / 'resumed'}",
            f"trainer.resume={out / 'full' / 'checkpoints' / 'step-000001'}",
        ],
        "async": [*fsdp, "trainer.async_save=true", f"trainer.output_dir={out / 'async'}"],
    }
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    result = torchrun(script, [str(out), "dit", json.dumps(runs)], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _step(run, step: int):
    return run / "checkpoints" / f"step-{step:06d}"


def test_each_rank_writes_its_shards_and_a_resume_on_two_ranks_is_bit_exact(sharded_run):
    first = _step(sharded_run / "full", 1)
    assert sorted(p.name for p in (first / SHARDS_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not (first / "trainable.safetensors").exists() and not (first / "optimizer.pt").exists()
    state = read_checkpoint_state(first)
    assert state["format"] == "sharded" and state["sharded"] is True
    hashes = json.loads((first / "hashes.json").read_text())
    assert {"shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= set(hashes)
    full, resumed = (read_trained_weights(_step(sharded_run / name, 2)) for name in ("full", "resumed"))
    assert full.keys() == resumed.keys() and full
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


def test_a_checkpoint_written_in_the_background_is_the_same_checkpoint(sharded_run):
    # Step 1's checkpoint was written by DCP's async_save while step 2 trained, and made final (hashed, state
    # file last, renamed) when step 2's checkpoint started; step 2's, the run's last, was written at once.
    for step in (1, 2):
        written, background = (_step(sharded_run / name, step) for name in ("full", "async"))
        assert verify_checkpoint(background) is None, step  # every file hashed and intact
        assert read_checkpoint_state(background) == read_checkpoint_state(written)
        assert (
            json.loads((background / "hashes.json").read_text()).keys()
            == json.loads((written / "hashes.json").read_text()).keys()
        )
        expected, got = read_trained_weights(written), read_trained_weights(background)
        assert expected.keys() == got.keys() and expected
        for name in expected:
            assert torch.equal(expected[name], got[name]), (step, name)
    assert not list((sharded_run / "async" / "checkpoints").glob("*.tmp"))


def test_async_save_needs_the_sharded_format():
    with pytest.raises(ConfigError) as err:
        load_config(["trainer.async_save=true"], "t2i_training")
    assert err.value.key == "trainer.async_save" and "checkpoint_format=sharded" in str(err.value)


def test_one_rank_resumes_a_two_rank_sharded_checkpoint(sharded_run, tmp_path):
    first = _step(sharded_run / "full", 1)
    overrides = [*ARGS, f"trainer.output_dir={tmp_path / 'one'}", f"trainer.resume={first}"]
    trainer = DiTTrainer(load_config(overrides))  # one process: ddp
    params = dict(trainer.policy.trainable.named_parameters())
    saved = read_trained_weights(first)
    assert saved.keys() == {n for n, p in params.items() if p.requires_grad}
    for name, value in saved.items():
        assert torch.equal(params[name].detach(), value), name
    state = trainer.policy.optimizer.state
    assert len(state) == len(saved) and all(int(s["step"]) == 1 for s in state.values())
    assert all(s["exp_avg"].abs().sum() > 0 for s in state.values() if s["exp_avg"].numel() > 4)
    assert trainer.train() == tmp_path / "one"
    assert (_step(tmp_path / "one", 2) / SHARDS_DIR / ".metadata").is_file()


def test_a_sharded_checkpoint_exports_to_plain_diffusers(sharded_run, tmp_path):
    last = _step(sharded_run / "full", 2)
    assert export_main(["--checkpoint", str(sharded_run / "full"), "--output", str(tmp_path / "x")]) == 0
    (exported,) = (tmp_path / "x" / "transformer").glob("*.safetensors")
    exported_weights, trained = load_file(str(exported)), read_trained_weights(last)
    for name, value in trained.items():
        assert torch.equal(exported_weights[name], value), name


def test_a_damaged_shard_is_refused_naming_it_and_latest_falls_back(sharded_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(sharded_run / "full", run)
    shard = _step(run, 2) / SHARDS_DIR / "__1_0.distcp"
    with shard.open("ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        resolve_resume(str(_step(run, 2)), run)
    assert resolve_resume("latest", run) == _step(run, 1)

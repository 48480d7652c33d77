"""DiffusionNFT end to end (`DiTTrainer`): the default run learns, resume is exact, LoRA with KL, evaluation
and export of an NFT run, 2 ranks under torchrun, and the config selects the algorithm."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DIT_SMALL, PYTHON, run_cli, torchrun
from safetensors.torch import load_file

from glm_training.algorithms.nft.algorithm import OLD_POLICY_FILE
from glm_training.cli import run
from glm_training.config import ConfigError, NFTTrainConfig, load_config, load_run_config
from glm_training.engine.trainer import DiTTrainer
from glm_training.metrics import read_metrics

SMALL = DIT_SMALL


@pytest.mark.slow
def test_default_nft_run_learns(tmp_path):
    """`python train_dit.py --config configs/nft_training.yaml`, shortened: tiny model, jpeg reward, CPU."""
    # In process, through the entry point's own call (the subprocess path is test_dit_training's).
    assert run(DiTTrainer, "nft_training", [f"trainer.output_dir={tmp_path}", "trainer.num_steps=20"]) == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert {"loss", "positive_loss", "negative_loss", "old_decay", "r_mean"} <= set(rows[0])
    assert "clip_frac" not in rows[0]  # Flow-GRPO's statistics belong to the other trainer
    rewards = np.array([r["reward_mean"] for r in rows])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    # Per-step noise of the mean reward is ~0.02-0.04. Measured in 20 steps, trainer.seed 0-4 under the pinned
    # numerics (benchmarks/learning_margins.py nft): +0.157, +0.129, +0.132, +0.261, +0.045 (training);
    # +0.177, +0.169, +0.095, +0.199, -0.079 (held out). Seed 4 clears neither bar: this run's signal is too
    # weak for five seeds.
    assert last - first > 0.06, rewards.round(3).tolist()
    evals = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*.json")}
    assert sorted(evals) == [0, 10, 20]
    assert evals[20]["reward_mean"] > evals[0]["reward_mean"], {s: e["reward_mean"] for s, e in evals.items()}
    # The old model follows the reference's decay_type=1 schedule: min(0.001 k, 0.5) after k optimizer steps.
    assert [r["old_decay"] for r in rows[:3]] == pytest.approx([0.001, 0.002, 0.003])


def test_nft_resume_is_bit_exact(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "trainer.save_every=2", "algo.num_mini_batches=2", "sampling.micro_batch_size=3"]
    assert run(DiTTrainer, "nft_training", [*args, "trainer.num_steps=4", f"trainer.output_dir={full}"]) == 0
    assert run(DiTTrainer, "nft_training", [*args, "trainer.num_steps=2", f"trainer.output_dir={part}"]) == 0
    resumed = [*args, "trainer.num_steps=4", f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run(DiTTrainer, "nft_training", resumed) == 0
    final_a, final_b = full / "checkpoints" / "step-000004", part / "checkpoints" / "step-000004"
    a, b = (
        load_file(str(final_a / "trainable.safetensors")),
        load_file(str(final_b / "trainable.safetensors")),
    )
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[n], b[n]) for n in a)
    old_a, old_b = (torch.load(p / OLD_POLICY_FILE, weights_only=True) for p in (final_a, final_b))
    assert old_a.keys() == a.keys() and all(torch.equal(old_a[n], old_b[n]) for n in a)
    # The old model is an EMA, not the policy: it lags behind it.
    assert any(not torch.equal(old_a[n], a[n]) for n in a)
    rows_full, rows_part = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows_part] == [1, 2, 3, 4]
    for x, y in zip(rows_full, rows_part):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == y["loss"]
    assert rows_full[0]["num_optimizer_steps"] == 2.0


def test_lora_nft_with_kl_then_evaluate_and_export(tmp_path):
    """LoRA (old adapters swapped in), the KL to the base model, then evaluation and export of the run."""
    run_dir = tmp_path / "run"
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "algo.beta=0.01"]
    assert (
        run(
            DiTTrainer,
            "nft_training",
            [*SMALL, *lora, "trainer.num_steps=2", f"trainer.output_dir={run_dir}"],
        )
        == 0
    )
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[1]["kl"] > 0 and rows[1]["old_deviation"] > 0
    ckpt = run_dir / "checkpoints" / "step-000002"
    weights, old = load_file(str(ckpt / "trainable.safetensors")), torch.load(ckpt / OLD_POLICY_FILE)
    assert weights and all("lora" in n for n in weights) and old.keys() == weights.keys()
    cfg = load_run_config(ckpt / "config.yaml")
    assert isinstance(cfg, NFTTrainConfig) and cfg.algo.beta == 0.01

    evaluation = run_cli(
        [
            PYTHON,
            "-m",
            "glm_training.evaluate",
            "--checkpoint",
            str(run_dir),
            "--output",
            str(tmp_path / "e"),
        ],
        timeout=300,
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    assert np.isfinite(json.loads((tmp_path / "e" / "000002.json").read_text())["reward_mean"])
    export = run_cli(
        [PYTHON, "-m", "glm_training.export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "x")],
        timeout=300,
    )
    assert export.returncode == 0, export.stderr[-3000:]
    assert (tmp_path / "x" / "export_info.json").is_file()


@pytest.mark.distributed
@pytest.mark.slow
def test_nft_under_torchrun(tmp_path):
    args = [
        *SMALL,
        "--config",
        "configs/nft_training.yaml",
        "trainer.num_steps=2",
        f"trainer.output_dir={tmp_path}",
    ]
    result = torchrun("train_dit.py", args, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["num_optimizer_steps"] == 1.0
    ckpt = tmp_path / "checkpoints" / "step-000002"
    assert (ckpt / "rng_rank1.pt").is_file() and (ckpt / OLD_POLICY_FILE).is_file()


def test_algo_name_selects_the_schema_and_errors_name_the_fix():
    cfg = load_config(["--config", "configs/nft_training.yaml"], "t2i_training")
    assert isinstance(cfg, NFTTrainConfig) and cfg.algo.name == "nft" and cfg.sampling.guidance_scale == 1.0
    assert load_config([], "t2i_training").algo.name == "flow_grpo"
    with pytest.raises(ConfigError, match="configs/nft_training.yaml"):
        load_config(["algo.name=nft"], "t2i_training")
    with pytest.raises(ConfigError, match="algo.decay_type"):
        load_config(["--config", "configs/nft_training.yaml", "algo.decay_type=3"], "t2i_training")
    # The old model is sharded like the parameters (tests/test_fsdp_policy_copies.py).
    assert (
        load_config(["--config", "configs/nft_training.yaml", "trainer.strategy=fsdp"]).trainer.strategy
        == "fsdp"
    )
    with pytest.raises(ConfigError, match="algo.nft_beta"):
        load_config(["--config", "configs/nft_training.yaml", "algo.nft_beta=0"], "t2i_training")


@pytest.mark.parametrize("guidance", [1.0])  # CFG-free, as NFT samples; CFG shares `predict_velocity`
def test_nft_rollout_is_the_pipelines_ode_and_keeps_only_final_latents(tiny_model_dir, guidance):
    from diffusers import GlmImagePipeline

    from glm_training.algorithms.decoder.ode import keep_for_update, sample_ode
    from glm_training.pipeline.dit import build_guidance_inputs, glm_image_schedule

    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    prompts = ["a sign that says 'OPEN'"] * 2
    prior, _, _ = pipe.generate_prior_tokens(
        prompt=prompts[:1], height=64, width=64, generator=torch.Generator().manual_seed(0)
    )
    prior = prior.repeat(2, 1)
    latents = torch.randn(
        (2, pipe.transformer.config.in_channels, 8, 8), generator=torch.Generator().manual_seed(1)
    )
    expected = pipe(
        prompt=prompts,
        prior_token_ids=prior,
        latents=latents.clone(),
        height=64,
        width=64,
        num_inference_steps=5,
        guidance_scale=guidance,
        output_type="latent",
    ).images
    timesteps, sigmas = glm_image_schedule(pipe, 5, 64, 64)
    cond = build_guidance_inputs(pipe, prompts, prior, 64, 64, guidance, torch.device("cpu"), torch.float32)
    final = sample_ode(pipe.transformer, latents.clone(), cond, timesteps, sigmas, guidance_scale=guidance)
    torch.testing.assert_close(final, expected, rtol=0, atol=0)
    kept = keep_for_update(cond, final)
    assert kept.cond.negative_embeds is None and torch.equal(kept.final_latents, final)
    assert kept.num_bytes() == final.numel() * 4 + sum(
        t.numel() * t.element_size()
        for t in (cond.prompt_embeds, cond.prior_token_ids, cond.target_size, cond.crop_coords)
    )

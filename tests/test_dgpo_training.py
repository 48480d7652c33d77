"""DGPO end to end (`DiTTrainer` with the `DGPO` algorithm): the tiny default run learns; one update's
gradient equals the authors' loss (`test_dgpo.py`'s transcription) on the same velocities; with the KL, the
clip and the EMA reference sampling, resume is bit-exact and the reference is saved; the config refuses what
the algorithm cannot do, naming the key; DGPO lives in its folder."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import DIT_SMALL, REPO, assert_resumed_run_matches
from safetensors.torch import load_file
from test_dgpo import reference_step

from glm_training.algorithms.dgpo.algorithm import DGPO, EMA_REF_FILE
from glm_training.algorithms.dgpo.losses import train_time_indices
from glm_training.cli import run
from glm_training.config import ConfigError, load_config
from glm_training.metrics import read_metrics
from glm_training.pipeline.dit import predict_velocity

SMALL = [*DIT_SMALL, "algo.trunc_steps=2", "algo.train_timesteps=2"]


@pytest.mark.slow
def test_default_dgpo_run_learns(tmp_path):
    """`train_dit.py --config configs/dgpo_training.yaml`'s own call, shortened to 20 steps: tiny model, jpeg
    reward."""
    args = [f"trainer.output_dir={tmp_path}", "trainer.num_steps=20"]
    assert run("dit", "dgpo_training", args) == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert {"loss", "policy_loss", "matching_loss", "clip_frac", "group_weight", "ref_decay"} <= set(rows[0])
    assert "r_mean" not in rows[0] and "weight_mean" not in rows[0]  # the other trainers' statistics
    rewards = np.array([r["reward_mean"] for r in rows])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    # Per-step noise of the mean reward is ~0.02-0.04; measured in 20 steps, trainer.seed 0-4 under the pinned
    # numerics (benchmarks/learning_margins.py dgpo): +0.29, +0.53, +0.35, +0.20, +0.43 (training); +0.31,
    # +0.26, +0.15, +0.10, +0.078 (held out).
    assert last - first > 0.08, rewards.round(3).tolist()
    evals = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*.json")}
    assert sorted(evals) == [0, 10, 20]
    assert evals[20]["reward_mean"] > evals[0]["reward_mean"] + 0.04, {
        s: e["reward_mean"] for s, e in evals.items()
    }


def _trainer(tmp_path, *extra: str):
    from glm_training.engine.trainer import DiTTrainer

    args = ["--config", "configs/dgpo_training.yaml", *SMALL, f"trainer.output_dir={tmp_path}", *extra]
    return DiTTrainer(load_config(args, "t2i_training"))


@pytest.mark.parametrize("kl_cfg", [1.0, 4.5])
def test_one_update_has_the_gradient_of_the_authors_loss(tmp_path, kl_cfg):
    """The algorithm's backward passes (micro-batches of 2, group sums from its no-grad pass over every
    micro-batch, shared noise and times) against `reference_step` (the authors' loss, transcribed in
    test_dgpo.py) on the whole batch as one micro-batch, at the same times and noise, plus beta times the KL.
    The policy, the base model and the EMA reference all differ, so the weights, the clip and the KL act.
    With `algo.kl_cfg` > 1 the base velocity of the KL and the group sums is the authors' `ref_old_v =
    predict_v(..., cfg=True, cfg_scale=kl_cfg)`: guided, its unconditional pass on the pipeline's negative
    prompt, though the rollout samples without CFG (their config/dgpo_wocfg.py)."""
    trainer = _trainer(
        tmp_path,
        "sampling.micro_batch_size=2",
        "algo.beta=0.5",
        "algo.clip_range=2e-3",
        f"algo.kl_cfg={kl_cfg}",
    )
    algo = trainer.algorithm
    assert isinstance(algo, DGPO)
    params = [p for p in trainer.policy.trainable.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:  # policy != EMA reference != base model
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
        algo.ema_ref.update(0.5)
        for p in params:
            p.add_(0.02 * torch.randn(p.shape, generator=generator))
    batch = trainer.collect(0)
    rollout, a = batch.rollout, trainer.cfg.algo
    adv = batch.advantages.float()
    assert len(rollout.samples) == 3 and (adv != 0).any()
    times = train_time_indices(
        a.trunc_steps, a.train_timesteps, torch.Generator().manual_seed(algo.step_seed(0))
    )
    times = times.tolist()

    denominator = adv.numel() * len(times)
    clipped = []
    for time in times:
        held = {}
        for m in range(len(rollout.samples)):
            stats = algo.loss_and_backward(held, rollout, adv, 0, time, m, denominator)
            clipped.append(stats["clip_frac"])
    ours = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    x0 = torch.cat([c.final_latents for c in rollout.samples])
    cond = [c.cond for c in rollout.samples]
    assert all(c.negative_embeds is None for c in cond)  # sampled at guidance 1: no CFG inputs kept
    if kl_cfg > 1:  # the pipeline's own unconditional inputs: the negative prompt "" for every sample
        pipe = trainer.policy.wrapper.pipeline
        with torch.no_grad():
            _, negative = pipe.encode_prompt(
                ["x"] * x0.shape[0], True, device=x0.device, dtype=cond[0].prompt_embeds.dtype
            )
        cond = [replace(c, negative_embeds=negative[algo._rows(rollout, m)]) for m, c in enumerate(cond)]
    model = trainer.policy.model
    total = 0.0
    for time in times:
        noise = algo.noise(0, time, rollout.group_ids, x0.shape[1:])
        x_t = (1 - rollout.sigmas[time]) * x0 + rollout.sigmas[time] * noise
        timestep, target = rollout.timesteps[time].expand(x0.shape[0]), noise - x0
        velocities = {"model": [], "base": [], "old": []}
        for m, c in enumerate(cond):
            rows = algo._rows(rollout, m)
            velocities["model"].append(predict_velocity(model, x_t[rows], timestep[rows], c, 1.0).float())
            with torch.no_grad(), trainer.policy.reference_model() as base:
                guided = predict_velocity(base, x_t[rows], timestep[rows], c, kl_cfg)  # u + g (c - u)
                velocities["base"].append(guided.float())
            with torch.no_grad(), algo.ema_ref.module() as old:
                velocities["old"].append(predict_velocity(old, x_t[rows], timestep[rows], c, 1.0).float())
        v, v_base, v_old = (torch.cat(velocities[k]) for k in ("model", "base", "old"))
        loss = reference_step(
            v,
            v_base,
            v_old,
            target,
            adv,
            rollout.group_ids,
            a.beta_dpo,
            trainer.cfg.data.num_generations,
            a.clip_range,
        )
        kl = (v - v_base).square().reshape(v.shape[0], -1).mean(dim=1).mean()
        total = total + (loss + a.beta * kl) / len(times)
    expected = torch.autograd.grad(total, params)
    # Different micro-batch splits sum the same terms in another order: float32 rounding, 1e-5 relative
    # (measured on a Zen 4: at most 6% of this bound).
    for g_ours, g_ref in zip(ours, expected):
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    assert any(f > 0 for f in clipped) and any(f < 1 for f in clipped), clipped


def test_a_step_skipped_as_non_finite_does_not_count_for_the_ema_reference(tmp_path):
    """The authors move the EMA reference after each optimizer step with decay min(0.3, 0.001 k), k the steps
    before it. A step skipped as non-finite (a NaN loss, `Policy.optimizer_step`) neither moves it nor counts:
    the next step is still k = 0."""
    trainer = _trainer(tmp_path)
    algo, policy = trainer.algorithm, trainer.policy
    batch = trainer.collect(0)
    before = {n: w.clone() for n, w in algo.ema_ref.weights.items()}
    leaf = [m for m in policy.trainable.modules() if isinstance(m, torch.nn.Linear)][-1]
    hook = leaf.register_forward_hook(lambda m, i, out: out * math.nan)
    try:
        skipped = algo.update(batch, 0)
    finally:
        hook.remove()
    assert policy.num_skipped_nonfinite == 1 and algo.optimizer_steps() == 0
    assert skipped["ref_decay"] == 1.0  # no move
    assert all(torch.equal(before[n], w) for n, w in algo.ema_ref.weights.items())
    decays = [algo.update(batch, step)["ref_decay"] for step in (1, 2)]
    assert decays == pytest.approx([0.0, 0.001]) and algo.optimizer_steps() == 2


def test_dgpo_with_its_kl_and_ema_reference_sampling_resumes_bit_exact(tmp_path):
    """The EMA reference lags the policy, samples the rollouts after `switch_ema_ref` optimizer steps, is
    checkpointed, and resumes exactly."""
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "trainer.save_every=1", "algo.beta=0.02", "algo.switch_ema_ref=1"]
    assert run("dit", "dgpo_training", [*args, "trainer.num_steps=3", f"trainer.output_dir={full}"]) == 0
    assert run("dit", "dgpo_training", [*args, "trainer.num_steps=2", f"trainer.output_dir={part}"]) == 0
    resumed = [*args, "trainer.num_steps=3", f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run("dit", "dgpo_training", resumed) == 0
    rows = assert_resumed_run_matches(full, part, 3)
    final_a, final_b = full / "checkpoints" / "step-000003", part / "checkpoints" / "step-000003"
    a = load_file(str(final_a / "trainable.safetensors"))
    ref_a, ref_b = (torch.load(p / EMA_REF_FILE, weights_only=True) for p in (final_a, final_b))
    assert ref_a.keys() == a.keys() and all(torch.equal(ref_a[n], ref_b[n]) for n in a)
    assert any(not torch.equal(ref_a[n], a[n]) for n in a)  # an EMA lags the policy
    # The image statistics' change from step 1 continues from the saved step-1 values (image_monitor.pt).
    changes = [k for k in rows[0][0] if k.startswith("image/") and k.endswith("_change")]
    assert changes and all(x[k] == y[k] for x, y in rows for k in changes)
    assert any(rows[2][1][k] != 0 for k in changes)
    rows_full = [x for x, _ in rows]
    # d = min(0.3, 0.001 k) after k earlier optimizer steps; the reference samples once 2 > 1 are done.
    assert [r["ref_decay"] for r in rows_full] == pytest.approx([0.0, 0.001, 0.002])
    assert [r["sampled_by_ema_ref"] for r in rows_full] == [0.0, 0.0, 1.0]
    assert rows_full[0]["kl"] == 0.0 < rows_full[1]["kl"]  # the first update starts at the base model


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.num_mini_batches=2", "algo.num_mini_batches"),
        ("algo.num_inner_epochs=2", "algo.num_inner_epochs"),
        ("algo.trunc_steps=6", "algo.trunc_steps"),  # past the 6-step schedule's last index
        ("algo.train_timesteps=6", "algo.train_timesteps"),  # more than {0, ..., 4} holds
        ("algo.dpo_reference=old", "algo.dpo_reference"),
        ("data.num_generations=1", "data.num_generations"),
        ("algo.beta_dpo=0", "algo.beta_dpo"),
        ("algo.kl_cfg=0.5", "algo.kl_cfg"),
    ],
)
def test_the_config_refuses_what_dgpo_cannot_do_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(["--config", "configs/dgpo_training.yaml", override], "t2i_training")


def test_a_full_fine_tune_keeps_the_base_model_for_the_group_sums_without_a_kl(tmp_path):
    """beta = 0: the KL needs no base model, DGPO's group sums do (its `uses_reference`)."""
    cfg = load_config(["--config", "configs/dgpo_training.yaml", "algo.beta=0"], "t2i_training")
    assert not cfg.model.lora.enabled and cfg.algo.uses_reference()
    cfg = load_config(
        ["--config", "configs/dgpo_training.yaml", "algo.dpo_reference=ema_ref"], "t2i_training"
    )
    assert not cfg.algo.uses_reference()


def test_every_file_that_names_dgpo_is_in_its_folder_but_its_registration_line():
    package = REPO / "glm_training"
    outside = []
    for path in package.rglob("*.py"):
        if path.is_relative_to(package / "algorithms" / "dgpo"):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if "dgpo" in line.lower():
                outside.append(f"{path.relative_to(REPO)}: {line.strip()}")
    assert outside == ['glm_training/config/algorithms.py: "glm_training.algorithms.dgpo",'], outside

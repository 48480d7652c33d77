"""`python train_joint.py`: both halves from one rollout. The default run raises both rewards and changes both
halves; with the AR frozen the DiT's update is the DiT trainer's on the same rollout, and with the DiT frozen
and one ODE rendering per prior the AR's update is the AR trainer's; resume is bit-exact, also after a stop
between the two halves' saves; DAPO's filter drops flat AR groups from the AR update only; bad input stops
before loading, naming the key and the fix."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.config import ConfigError, load_config
from glm_training.metrics import read_metrics

# A joint run small enough for a test: 64x64, 3 DiT steps, 2 prompts x 2 priors x 2 renderings, no evaluation.
SMALL = [
    "trainer.progress_bar=false",
    "eval.every_n_steps=0",
    "ar.sampling.height=64",
    "ar.sampling.width=64",
    "dit.sampling.height=64",
    "dit.sampling.width=64",
    "dit.sampling.num_steps=3",
    "data.num_groups_per_step=2",
    "data.num_priors=2",
    "data.renderings_per_prior=2",
]


def _cfg(tmp_path, *extra: str):
    return load_config([*SMALL, f"trainer.output_dir={tmp_path}", *extra], "joint_training")


def _weights(run_dir, half: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / half / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_default_run_raises_both_rewards_and_trains_both_halves(tmp_path):
    """`train_joint.py`'s own call (30 steps, evaluating every 15): tiny model, JPEG reward on both halves."""
    assert run("joint", "joint_training", [f"trainer.output_dir={tmp_path}"]) == 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    for half in ("ar", "dit"):
        rewards = np.array([r[f"{half}_reward_mean"] for r in rows])
        # Both halves score with the same JPEG reward here, so the two curves are one. Measured over the 30
        # steps, trainer.seed 0-4 under the pinned numerics (benchmarks/learning_margins.py joint): +0.66,
        # +1.22, +1.11, +0.32, +0.18; per-step noise ~0.1. (At 20 steps seeds 3 and 4 gained +0.007 and
        # +0.071: the whole default run is what five seeds clear.)
        assert rewards[-5:].mean() - rewards[:5].mean() > 0.15, (half, rewards.round(3).tolist())
        assert {f"{half}_loss", f"{half}_grad_norm", f"{half}_lr"} <= set(rows[0])
        before, after = _weights(tmp_path, half, 20), _weights(tmp_path, half, 30)
        assert any(not torch.equal(before[n], after[n]) for n in before), half
    evals = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*.json")}
    assert sorted(evals) == [0, 15, 30]
    assert {"eval/ar_reward_mean", "eval/dit_reward_mean"} <= set(rows[-1])
    # The held-out evaluation (both trained halves, deterministic sampling) gains too: measured (seeds 0-4,
    # pinned) +0.71, +0.90, +1.39, +0.53, +0.14 from -13.53 (at 20 steps seed 4 went -0.175).
    assert evals[30]["reward_mean"] > evals[0]["reward_mean"] + 0.1, {
        s: e["reward_mean"] for s, e in evals.items()
    }


class GivenPriors:
    """The DiT trainer's prior tokens and initial noise: the joint run's (`Parts.priors`)."""

    eval_tokens = None

    def __init__(self, tokens: torch.Tensor, latents: torch.Tensor):
        self.tokens, self.latents = tokens, latents

    def step_tokens(self, texts, seed, step):
        return self.tokens

    def initial_latents(self):
        return self.latents


def test_with_the_ar_frozen_the_dit_update_is_the_dit_trainers(tmp_path):
    """One step with `ar.optim.lr=0`: the DiT trainer, given the joint run's priors as its groups (one prompt,
    so both runs draw the same) and their initial noise, and drawing from the joint run's DiT seed stream,
    ends with the joint run's DiT weights bit for bit (same kernels, same order) and the same rewards and
    loss."""
    from glm_training.engine.trainer import DiTTrainer
    from glm_training.joint.trainer import SEED_STREAMS, JointTrainer

    (tmp_path / "one.txt").write_text("a red cube on a table\n")
    extra = [f"data.prompt_file={tmp_path / 'one.txt'}", "trainer.num_steps=1", "ar.optim.lr=0"]
    joint = JointTrainer(_cfg(tmp_path / "joint", *extra))
    joint.train()
    cfg = joint.cfg.half("dit")
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(tmp_path / "dit")))
    assert (cfg.data.num_groups_per_step, cfg.data.num_generations) == (4, 2)  # 2 prompts x 2 priors
    priors = GivenPriors(joint.priors.tokens, joint.priors.latents)
    DiTTrainer(cfg, priors=priors, seed_stream=SEED_STREAMS["dit"]).train()
    _assert_equal(
        _weights(tmp_path / "joint", "dit", 1),
        load_file(str(tmp_path / "dit/checkpoints/step-000001/trainable.safetensors")),
    )
    (a,), (b,) = (
        read_metrics(tmp_path / "joint" / "metrics.jsonl"),
        read_metrics(tmp_path / "dit" / "metrics.jsonl"),
    )
    assert a["dit_reward_mean"] == b["reward_mean"] and a["dit_loss"] == b["loss"]
    # At the first ratio (exactly 1) the loss is -mean(advantages), 0 but for rounding (0.0 on this rollout):
    # the gradient shows that the update compared is not empty.
    assert a["dit_grad_norm"] == b["grad_norm"] > 0


def test_with_the_dit_frozen_the_ar_update_is_the_ar_trainers(tmp_path):
    """Two steps with `dit.optim.lr=0`, one ODE rendering per prior (per_prompt groups, each prompt's priors
    rendered from one noise): the AR trainer on the same settings ends with the joint run's AR weights bit for
    bit, with the same rewards and loss at every step."""
    from glm_training.engine.trainer import ARTrainer

    extra = [
        "trainer.num_steps=2",
        "dit.optim.lr=0",
        "data.renderings_per_prior=1",
        "dit.sampling.noise_level=0",
        "dit.sampling.micro_batch_size=4",
        "ar.algo.micro_batch_size=4",
    ]
    cfg = _cfg(tmp_path / "joint", *extra)
    assert cfg.data.grouping() == "per_prompt"
    assert run("joint", "joint_training", [*SMALL, f"trainer.output_dir={tmp_path / 'joint'}", *extra]) == 0
    ar = cfg.half("ar")
    ar = dataclasses.replace(ar, trainer=dataclasses.replace(ar.trainer, output_dir=str(tmp_path / "ar")))
    ARTrainer(ar).train()
    _assert_equal(
        _weights(tmp_path / "joint", "ar", 2),
        load_file(str(tmp_path / "ar/checkpoints/step-000002/trainable.safetensors")),
    )
    joint_rows, ar_rows = (
        read_metrics(tmp_path / "joint" / "metrics.jsonl"),
        read_metrics(tmp_path / "ar" / "metrics.jsonl"),
    )
    for a, b in zip(joint_rows, ar_rows, strict=True):
        assert a["ar_reward_mean"] == b["reward_mean"] and a["ar_loss"] == b["loss"]
    assert joint_rows[1]["ar_loss"] != 0


def test_resume_is_bit_exact_and_the_export_holds_both_halves(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run("joint", "joint_training", [*SMALL, f"trainer.output_dir={full}", "trainer.num_steps=3"]) == 0
    assert run("joint", "joint_training", [*SMALL, f"trainer.output_dir={part}", "trainer.num_steps=2"]) == 0
    resumed = [*SMALL, f"trainer.output_dir={part}", "trainer.num_steps=3", "trainer.resume=latest"]
    assert run("joint", "joint_training", resumed) == 0
    for half in ("ar", "dit"):
        _assert_equal(_weights(full, half, 3), _weights(part, half, 3))
    rows_full, rows_part = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows_part] == [1, 2, 3]
    keys = ("ar_reward_mean", "dit_reward_mean", "ar_loss", "dit_loss")
    assert [[r[k] for k in keys] for r in rows_full] == [[r[k] for k in keys] for r in rows_part]
    # Each half's run folder is an ordinary one: the export writes one pipeline with both trained halves.
    from diffusers import GlmImagePipeline

    from glm_training.export import export

    pipe = GlmImagePipeline.from_pretrained(str(export([part / "dit", part / "ar"], tmp_path / "exported")))
    for half, component in (("ar", "vision_language_encoder"), ("dit", "transformer")):
        loaded = getattr(pipe, component).state_dict()
        for name, value in _weights(part, half, 3).items():
            assert torch.equal(loaded[name], value), (half, name)


class Preempted(Exception):
    """The process killed mid-save: nothing after it runs."""


def test_a_run_stopped_between_the_two_saves_resumes_by_itself(tmp_path, monkeypatch, caplog):
    """Stopped after the AR's checkpoint and before the DiT's: `trainer.resume=latest` resumes both halves
    from the newest step both saved (the start, when it stopped between the first two saves), sets the AR's
    unpaired checkpoint aside (kept, logged) and trains on. Stopped between the first saves, then again
    between the saves of step 2 (with `keep_last=1`: the halves prune once both saved), the run ends equal,
    bit for bit, to the run that was not stopped."""
    from glm_training.joint.trainer import JointTrainer

    full, stopped = tmp_path / "full", tmp_path / "stopped"
    args = [*SMALL, "trainer.num_steps=2", "trainer.save_every=1", "trainer.keep_last=1"]
    assert run("joint", "joint_training", [*args, f"trainer.output_dir={full}"]) == 0
    args.append(f"trainer.output_dir={stopped}")

    def stopped_at(stop: int, *extra: str) -> None:
        trainer = JointTrainer(load_config([*args, *extra], "joint_training"))
        dit_checkpoints = trainer.checkpoints.halves[1]
        save = dit_checkpoints.save

        def killed_at_the_stop(step: int, at_once: bool = True) -> None:
            if step == stop:
                raise Preempted
            save(step, at_once)

        monkeypatch.setattr(dit_checkpoints, "save", killed_at_the_stop)
        with pytest.raises(Preempted):
            trainer.train()

    def listed() -> dict[str, list[str]]:
        folders = {h: stopped / h / "checkpoints" for h in ("ar", "dit")}
        return {h: sorted(p.name for p in f.iterdir()) if f.is_dir() else [] for h, f in folders.items()}

    def steps_logged() -> list[int]:
        return [r["step"] for r in read_metrics(stopped / "metrics.jsonl")]

    stopped_at(1)
    assert listed() == {"ar": ["step-000001"], "dit": []} and steps_logged() == [1]
    stopped_at(2, "trainer.resume=latest")  # starts over, then stops between the saves of step 2
    assert listed() == {"ar": ["step-000001", "step-000001.unpaired", "step-000002"], "dit": ["step-000001"]}
    assert steps_logged() == [1, 2]  # the first try's row of step 1 dropped, then written again
    with caplog.at_level("WARNING", logger="glm_training"):
        assert run("joint", "joint_training", [*args, "trainer.resume=latest"]) == 0
    assert any("set the unpaired checkpoint" in r.getMessage() for r in caplog.records)
    unpaired = ["step-000001.unpaired", "step-000002", "step-000002.unpaired"]
    assert listed() == {"ar": unpaired, "dit": ["step-000002"]} and steps_logged() == [1, 2]
    for half in ("ar", "dit"):
        _assert_equal(_weights(full, half, 2), _weights(stopped, half, 2))
    kept = stopped / "ar" / "checkpoints" / "step-000002.unpaired"  # as it was written
    _assert_equal(_weights(full, "ar", 2), load_file(str(kept / "trainable.safetensors")))
    rows_full, rows_stopped = read_metrics(full / "metrics.jsonl"), read_metrics(stopped / "metrics.jsonl")
    keys = ("ar_reward_mean", "dit_reward_mean", "ar_loss", "dit_loss")
    assert [[r[k] for k in keys] for r in rows_full] == [[r[k] for k in keys] for r in rows_stopped]


def _checkpoint(run_dir, step: int, damaged: bool = False) -> None:
    """A checkpoint folder as `save_checkpoint` finishes one (a file, its hash, the state file last)."""
    from glm_training.checkpoint import STATE_FILE, checkpoint_dir, write_hashes

    folder = checkpoint_dir(run_dir, step)
    folder.mkdir(parents=True)
    (folder / "trainable.safetensors").write_bytes(b"weights")
    write_hashes(folder)
    if damaged:
        (folder / "trainable.safetensors").write_bytes(b"weightz")
    (folder / STATE_FILE).write_text(json.dumps({"step": step}))


@pytest.mark.parametrize(
    ("ar", "dit", "step", "passed"),
    [
        ([1, 2], [1], 1, [("ar", 2, "unpaired")]),  # stopped between the saves of step 2
        ([1, 2], [1, -2], 1, [("ar", 2, "unpaired"), ("dit", 2, "damaged")]),
        ([1], [], 0, [("ar", 1, "unpaired")]),  # between the first two saves: starts over
        ([1, 2], [1, 2], 2, []),
    ],
)
def test_the_resume_step_is_the_newest_both_halves_saved_intact(tmp_path, ar, dit, step, passed):
    """`find_paired_resume` on the halves' folders (a negative step: that checkpoint is damaged)."""
    from glm_training.checkpoint import checkpoint_dir, find_paired_resume

    halves = {"ar": tmp_path / "ar", "dit": tmp_path / "dit"}
    for half, steps in (("ar", ar), ("dit", dit)):
        for s in steps:
            _checkpoint(halves[half], abs(s), damaged=s < 0)
    expected = [(checkpoint_dir(halves[h], s), why) for h, s, why in passed]
    assert find_paired_resume(list(halves.values())) == (step, expected)


def test_the_resume_is_refused_without_checkpoints_or_with_only_damaged_ones(tmp_path):
    from glm_training.checkpoint import CheckpointError, find_paired_resume

    with pytest.raises(CheckpointError, match="holds a complete checkpoint"):
        find_paired_resume([tmp_path / "none" / "ar", tmp_path / "none" / "dit"])
    _checkpoint(tmp_path / "bad" / "ar", 1, damaged=True)
    with pytest.raises(CheckpointError, match="no step has an intact checkpoint of every half"):
        find_paired_resume([tmp_path / "bad" / "ar", tmp_path / "bad" / "dit"])


def test_an_unreadable_checkpoint_state_is_a_checkpoint_error_every_rank_raises(tmp_path):
    # Rank 0 decides the resume step and hands every rank its answer or its error (`agreed`): an error other
    # than a refusal (a trainer_state.json cut short) must travel the same way, or the other ranks would wait
    # in the broadcast for an answer that never comes.
    from glm_training.checkpoint import CheckpointError, find_paired_resume
    from glm_training.engine.checkpointing import agreed

    halves = [tmp_path / "ar", tmp_path / "dit"]
    for half in halves:
        _checkpoint(half, 1)
    state = halves[1] / "checkpoints" / "step-000001" / "trainer_state.json"
    state.write_text(state.read_text()[:5])
    with pytest.raises(CheckpointError, match="reading the checkpoints failed: JSONDecodeError"):
        agreed(lambda: find_paired_resume(halves), is_main=True)


def test_dynamic_sampling_drops_flat_ar_groups_from_the_ar_update_only(tmp_path):
    """An AR reward that is constant on one prompt's priors makes that group flat: DAPO's filter trains the AR
    on the other group; the DiT still trains on every image."""
    from glm_training.joint.trainer import JointTrainer

    (tmp_path / "two.txt").write_text("a red cube\na blue sphere\n")

    def cube_is_flat(images, prompts, metadata):
        return [0.0 if "cube" in p else float(np.asarray(im).mean()) for im, p in zip(images, prompts)]

    extra = [
        f"data.prompt_file={tmp_path / 'two.txt'}",
        "trainer.num_steps=1",
        "ar.algo.dynamic_sampling=true",
        "ar.algo.max_resample_rounds=0",
    ]
    trainer = JointTrainer(_cfg(tmp_path / "run", *extra), ar_reward_funcs=[cube_is_flat])
    trainer.train()
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["ar_frac_zero_std_groups"] == 0.5 and row["ar_trained_groups"] == 1
    assert row["ar_num_samples"] == 2  # the blue sphere's two priors
    assert row["dit_frac_zero_advantage"] < 1  # the DiT's renderings of every prior train


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("ar_reward.names=[]", "ar_reward.names", "name at least one reward"),
        ("dit.algo.beta=-1", "dit.algo.beta", "must be >= 0"),
        ("data.renderings_per_prior=0", "data.renderings_per_prior", "set >= 1"),
        ("data.num_priors=1", "data.num_priors", "set >= 2"),
        ("data.prior_cache=priors/base", "data.prior_cache", "remove data.prior_cache"),
        ("model.ar_weights=outputs/ar-run", "model.ar_weights", "model.name=PATH"),
        ("model.dit_weights=outputs/dit-run", "model.dit_weights", "model.name=PATH"),
        ("ar.sampling.height=96", "ar.sampling.height", "same size"),
        ("ar.algo.dynamic_sampling=true", "ar.algo.max_resample_rounds", "max_resample_rounds=0"),
        ("trainer.resume=outputs/x", "trainer.resume", "trainer.resume=latest"),
    ],
)
def test_bad_input_names_the_key_and_the_fix(override, key, fix):
    with pytest.raises(ConfigError) as err:
        load_config([override], "joint_training")
    assert err.value.key == key and fix in str(err.value)


def test_the_entry_point_refuses_before_loading(tmp_path, capsys):
    assert run("joint", "joint_training", [f"trainer.output_dir={tmp_path}", "dit_reward.names=[]"]) == 2
    assert "dit_reward.names" in capsys.readouterr().err
    # The tiny quick-start on the real model: refused, naming the joint recipe.
    assert run("joint", "joint_training", [f"trainer.output_dir={tmp_path}", "model=glm_image"]) == 2
    assert "--config-name recipes/joint_glm_image" in capsys.readouterr().err
    # A joint config given to another entry point, and the other way round.
    assert run("dit", "joint_training", [f"trainer.output_dir={tmp_path}"]) == 2
    assert "run it with train_joint.py" in capsys.readouterr().err
    assert run("joint", "t2i_training", [f"trainer.output_dir={tmp_path}"]) == 2
    assert "give train_joint.py a joint config" in capsys.readouterr().err
    assert not (tmp_path / "config.yaml").exists()
    from glm_training.joint.trainer import JointTrainer

    with pytest.raises(ConfigError, match="JointTrainer trains both halves"):
        JointTrainer(load_config([f"trainer.output_dir={tmp_path}"], "t2i_training"))


def test_each_priors_ar_reward_is_the_mean_over_its_renderings(tmp_path):
    """per_prior groups: the AR batch's reward of prior (g, p) is its R renderings' mean AR score, and its
    advantage compares it with its prompt's other priors; the DiT's compares the renderings of one prior."""
    from glm_training.engine.advantages import group_normalized_advantages
    from glm_training.joint.trainer import JointTrainer

    def mean_pixel(images, prompts, metadata):
        return [float(np.asarray(im).mean()) for im in images]

    trainer = JointTrainer(_cfg(tmp_path, "data.num_priors=3"), ar_reward_funcs=[mean_pixel])
    batch = trainer.collect(0)
    scores = torch.tensor(mean_pixel(batch.dit.images, None, None))
    assert len(scores) == 2 * 3 * 2 and batch.ar.rewards.shape == (6,)
    torch.testing.assert_close(batch.ar.rewards, scores.view(6, 2).mean(dim=1))
    expected = group_normalized_advantages(batch.ar.rewards.view(2, 3)).reshape(-1)
    torch.testing.assert_close(batch.ar.advantages, expected)
    assert batch.dit.rewards.shape == (12,) and batch.dit.advantages.view(6, 2).sum(dim=1).abs().max() < 1e-5
    assert trainer.priors.latents is None  # per_prior: the DiT's rollout draws its own noise


def test_the_memory_plan_counts_both_trained_halves_and_refuses_what_cannot_fit(capsys):
    """`python -m glm_training.plan` on the joint recipe: the DiT's plan with the AR half's own terms added
    (its state, units, buffers, reward models); 80 GB GPUs fit it under DDP, 40 GB ones do not."""
    from glm_training.plan.cli import main
    from glm_training.plan.components import meta_components
    from glm_training.plan.device import build_plan
    from glm_training.plan.joint import joint_plan

    args = ["--config", "recipes/joint_glm_image", "--world-size", "8", "--strategy", "ddp"]
    assert main([*args, "--gpu-memory-gb", "80"]) == 0
    table = capsys.readouterr().out
    for half in ("AR", "DiT"):
        for term in ("trainable (LoRA adapters)", "gradients", "optimizer state (AdamW)", "reward models"):
            assert f"{half}: {term}" in table
    assert main([*args, "--gpu-memory-gb", "40"]) == 1
    assert "does NOT fit" in capsys.readouterr().err
    cfg = load_config(["--config", "recipes/joint_glm_image"], "joint_training")
    modules = meta_components(cfg.model)
    plan = joint_plan(cfg.half("ar"), cfg.half("dit"), world_size=8, strategy="ddp", modules=modules)
    dit = build_plan(cfg.half("dit"), world_size=8, strategy="ddp", modules=modules)
    ar_own = [t for t in plan.static if t.name.startswith("AR: ")]
    assert len(ar_own) >= 4 and plan.peak == pytest.approx(dit.peak + sum(t.bytes for t in ar_own))


def test_the_recipe_trains_one_step_scaled_down(tiny_clip, tmp_path):
    """`recipes/joint_glm_image` on the tiny model (its LoRA on both halves, the tiny configs' learning
    rates), with the AR rewards on a tiny CLIP and the weight-free JPEG reward for OCR (as test_recipes.py
    scales the single-half recipes): one step trains both halves, each in its recipe's mini-batches."""
    from glm_training.joint.trainer import JointTrainer

    options = {
        "clip_score": {"model": tiny_clip, "device": "cpu"},
        "aesthetic": {"clip_model": tiny_clip, "head": tiny_clip / "head.pth", "device": "cpu"},
    }
    reward_options = [f"+ar_reward.options.{n}.{k}={v}" for n, o in options.items() for k, v in o.items()]
    overrides = [
        "model=tiny",
        *[f"{h}.sampling.{side}=32" for h in ("ar", "dit") for side in ("height", "width")],
        "data.prompt_file=",
        "data.num_groups_per_step=2",
        "data.num_priors=4",
        "data.renderings_per_prior=2",
        "ar.optim.lr=3e-3",
        "ar.optim.warmup_steps=0",
        "dit.optim.lr=1e-2",
        "dit.sampling.num_steps=3",
        "dit_reward.names=[jpeg_compressibility]",
        *reward_options,
        "trainer.num_steps=1",
        "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path}",
        "eval.every_n_steps=0",
        "logging.tensorboard=false",
    ]
    cfg = load_config(config="recipes/joint_glm_image", overrides=overrides)
    trainer = JointTrainer(cfg)
    trainer.train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    for half in ("ar", "dit"):
        assert np.isfinite(row[f"{half}_loss"]) and np.isfinite(row[f"{half}_reward_mean"])
    assert {"ar_reward/aesthetic", "ar_reward/clip_score", "dit_reward/jpeg_compressibility"} <= set(row)
    ar, dit = trainer.algorithm.ar, trainer.algorithm.dit
    assert len(ar.updates.last.mini_batches) == 4 and len(dit.updates.last.mini_batches) == 2
    assert all(p.wrapper.trainable is p.trainable for p in trainer.policies.values())
    assert "lora" in " ".join(
        n for n, _ in trainer.policies["ar_"].trainable.named_parameters() if "lora" in n
    )

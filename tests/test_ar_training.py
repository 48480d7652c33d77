"""The AR trainer: exact first ratio, dynamic sampling on 2 real ranks, resume, the default entry point."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import AR_SMALL, REPO, torchrun
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.config import ConfigError, load_config
from glm_training.engine.trainer import ARTrainer
from glm_training.metrics import read_metrics

SMALL = AR_SMALL


@pytest.mark.parametrize(
    "sampling",
    [
        ("sampling.temperature=1.0",),
        ("sampling.temperature=0.7", "sampling.top_p=0.8", "algo.dynamic_sampling=false"),
        ("sampling.temperature=1.3", "sampling.top_k=20", "algo.beta=0.05", "model.lora.enabled=true"),
        # GSPO with its own clip ranges; every group under the threshold (counted, still trained without
        # dynamic sampling).
        (
            "algo.importance_sampling_level=sequence",
            "algo.epsilon_low=3e-4",
            "algo.epsilon_high=4e-4",
            "algo.dynamic_sampling=false",
            "algo.min_group_std=1e9",
        ),
        # The folded sampler (adapters folded into a sampling copy) with verl's truncated importance weights.
        (
            "model.lora.enabled=true",
            "sampling.sampler=folded",
            "algo.rollout_is_threshold=2.0",
            "algo.rollout_is=true",
        ),
    ],
    ids=[
        "plain",
        "temp0.7-topp0.8-no-dynamic-sampling",
        "temp1.3-topk20-kl-lora",
        "gspo-all-flat",
        "folded-tis",
    ],
)
def test_first_inner_step_ratio_is_exactly_one(tmp_path, sampling):
    cfg = load_config([*SMALL, f"trainer.output_dir={tmp_path}", *sampling], "ar_training")
    trainer = ARTrainer(cfg)
    batch = trainer.collect(0)
    if cfg.algo.min_group_std > 0:
        assert batch.stats["frac_zero_std_groups"] == 1.0
    stats = trainer.update(batch, 0)
    assert stats["approx_kl"] == 0.0 and stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    assert stats["kl"] == 0.0
    # The teacher-forced pass reproduces the sampling distribution (temperature, top-p/top-k, positions).
    assert stats["sampling_logp_max_diff"] < 1e-4
    assert 0 <= stats["sampling_logp_mean_diff"] <= stats["sampling_logp_max_diff"]
    if cfg.algo.rollout_is_threshold is not None:  # weights exp(gap) within 1e-4 of 1: nothing truncated
        assert abs(stats["rollout_is_mean"] - 1) < 1e-4 and stats["rollout_is_ratio_fraction_high"] == 0
    assert stats["grad_norm"] > 0


def test_truncated_importance_weights_scale_the_policy_gradient_as_verl_does(tmp_path):
    """Golden test of algo.rollout_is on and off. Sampler log-probs 0.5 below the learner's on every
    token make every weight exp(0.5) (< the threshold 2), so the first update's gradient (one optimizer
    step; its norm before clipping) is exp(0.5) times the one without the correction; with the threshold at
    1.2 every weight is truncated to 1.2. (The first step's token-mean loss itself is ~0: group advantages
    sum to 0.)"""
    stats = {}
    for name, extra in {
        "off": ["algo.rollout_is_threshold=2.0"],
        "on": ["algo.rollout_is_threshold=2.0", "algo.rollout_is=true"],
        "truncated": ["algo.rollout_is_threshold=1.2", "algo.rollout_is=true"],
    }.items():
        overrides = [*SMALL, f"trainer.output_dir={tmp_path / name}", "algo.dynamic_sampling=false", *extra]
        trainer = ARTrainer(load_config(overrides, "ar_training"))
        batch = trainer.collect(0)
        for record in batch.rollout.records:
            record["sampling_log_probs"] = record["sampling_log_probs"] - 0.5 * record["completion_mask"]
        stats[name] = trainer.update(batch, 0)
    off = stats["off"]["grad_norm"]
    assert off > 0 and stats["off"]["rollout_is_mean"] == pytest.approx(np.exp(0.5), rel=1e-4)
    assert stats["on"]["grad_norm"] == pytest.approx(np.exp(0.5) * off, rel=1e-4)
    assert stats["truncated"]["grad_norm"] == pytest.approx(1.2 * off, rel=1e-4)
    assert stats["truncated"]["rollout_is_ratio_fraction_high"] == 1.0


def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*SMALL, "trainer.save_every=1"]
    assert run(ARTrainer, "ar_training", [*args, "trainer.num_steps=2", f"trainer.output_dir={full}"]) == 0
    assert run(ARTrainer, "ar_training", [*args, "trainer.num_steps=1", f"trainer.output_dir={part}"]) == 0
    resume = [*args, "trainer.num_steps=2", f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run(ARTrainer, "ar_training", resume) == 0
    a = load_file(str(full / "checkpoints" / "step-000002" / "trainable.safetensors"))
    b = load_file(str(part / "checkpoints" / "step-000002" / "trainable.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[n], b[n]) for n in a)


def _prompt_file(folder, name: str, noisy: int, flat: int):
    path = folder / f"{name}.txt"
    lines = [f"a noisy picture number {i}" for i in range(noisy)] + [
        f"a FLAT picture number {i}" for i in range(flat)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# The dynamic-sampling runs, one launch of 2 ranks for all: name -> (noisy prompts, flat prompts, reward,
# overrides). "in_step": 3 noisy prompts of 12, so several rounds are needed, and the groups a rank generates
# can be all flat on one rank and not on the other. "min_std": rank 1's reward is rank 0's times 1e-6, tiny
# but non-zero spread. "exhausted_*": one noisy prompt among eight and one extra round: at most 2 valid groups
# of the 4 wanted.
DYNAMIC_RUNS = {
    "in_step": (3, 9, "flat_unless_noisy", ["algo.max_resample_rounds=8"]),
    "min_std": (
        12,
        0,
        f"{REPO / 'tests' / 'user_rewards' / 'rank_spread.py'}:jpeg_size_tiny_on_rank1",
        ["algo.min_group_std=1e-4", "algo.max_resample_rounds=3"],
    ),
    "exhausted_error": (
        1,
        7,
        "flat_unless_noisy",
        ["algo.max_resample_rounds=1", "algo.on_budget_exhausted=error"],
    ),
    "exhausted_warn": (
        1,
        7,
        "flat_unless_noisy",
        ["algo.max_resample_rounds=1", "algo.on_budget_exhausted=warn"],
    ),
}


@pytest.fixture(scope="module")
def dynamic_runs(tmp_path_factory, tiny_model_dir):
    """{run name: [rank 0's report, rank 1's]} of DYNAMIC_RUNS, launched once under torchrun."""
    tmp = tmp_path_factory.mktemp("dynamic_sampling")
    runs = {}
    for name, (noisy, flat, reward, extra) in DYNAMIC_RUNS.items():
        runs[name] = [
            *SMALL,
            f"data.prompt_file={_prompt_file(tmp, name, noisy, flat)}",
            "data.num_groups_per_step=4",
            f"reward.names=['{reward}']",
            # At 32x32 the large grid is one token; with the pipeline's top-p 0.75 the two samples of a group
            # often pick the same one and tie, so "noisy" prompts would not reliably have reward spread.
            "sampling.temperature=1.0",
            "sampling.top_p=1.0",
            "sampling.top_k=0",
            "trainer.num_steps=1",
            f"trainer.output_dir={tmp / 'run' / name}",
            *extra,
        ]
    script = str(REPO / "tests" / "scripts" / "dist_ar_check.py")
    result = torchrun(script, [str(tmp), json.dumps(runs)], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {name: [report[name] for report in reports] for name in runs}


@pytest.mark.distributed
def test_dynamic_sampling_keeps_two_ranks_in_step(dynamic_runs):
    r0, r1 = dynamic_runs["in_step"]
    assert r0["finished"] and r1["finished"]  # no deadlock, through a full train() as well
    assert r0["stats"]["resample_rounds"] == r1["stats"]["resample_rounds"] > 1
    assert r0["num_samples"] == r1["num_samples"] == 4  # 4 groups x 2 generations over 2 ranks
    assert r0["all_on_own_device"] and r1["all_on_own_device"]
    assert r0["decisions"] == r1["decisions"]  # every decision from the same gathered data
    for group in r0["decisions"]:
        spread = max(group["rewards"]) > min(group["rewards"])
        assert group["kept"] == spread  # dropped groups are exactly the zero-std ones
        assert ("FLAT" in group["prompt"]) != spread
    assert all("FLAT" not in p for p in r0["trained_prompts"] + r1["trained_prompts"])
    assert r0["approx_kl"] == 0.0 and r0["ratio_mean"] == 1.0


@pytest.mark.distributed
def test_min_group_std_drops_the_groups_with_tiny_spread_on_both_ranks(dynamic_runs):
    # With min_group_std=1e-4 exactly rank 1's groups are flat; each round then yields rank 0's 2 groups, so
    # 2 rounds.
    r0, r1 = dynamic_runs["min_std"]
    assert r0["finished"] and r1["finished"]
    assert r0["decisions"] == r1["decisions"]  # the same decisions from the same gathered data
    assert r0["stats"] == r1["stats"]
    decisions = r0["decisions"]
    tiny = [d for d in decisions if max(abs(x) for x in d["rewards"]) < 1e-3]  # generated on rank 1
    assert len(tiny) == len(decisions) // 2 >= 2
    # Never exact ties (today's rule would keep them all), yet all dropped.
    assert all(max(d["rewards"]) > min(d["rewards"]) and not d["kept"] for d in tiny)
    for d in decisions:
        assert d["kept"] == (float(np.std(d["rewards"])) >= 1e-4)
    assert r0["stats"]["resample_rounds"] == 2 and r0["stats"]["valid_groups"] == 4
    # frac_zero_std_groups is the fraction under the threshold: the dropped groups of every round.
    assert r0["stats"]["frac_zero_std_groups"] == sum(not d["kept"] for d in decisions) / len(decisions)
    assert r0["num_samples"] == r1["num_samples"] == 4
    assert r0["approx_kl"] == 0.0 and r0["ratio_mean"] == 1.0


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["error", "warn"])
def test_dynamic_sampling_budget_exhausted(dynamic_runs, mode):
    reports = dynamic_runs[f"exhausted_{mode}"]
    assert len(reports) == 2
    if mode == "error":
        for report in reports:
            assert "dynamic sampling found" in report["error"] and "max_resample_rounds" in report["error"]
    else:
        r0, r1 = reports
        assert r0["finished"] and r1["finished"]
        assert r0["stats"]["resample_rounds"] == r1["stats"]["resample_rounds"] == 2
        assert r0["stats"]["valid_groups"] < 4
        assert r0["num_samples"] == r1["num_samples"]
        assert r0["stats"]["trained_groups"] == r0["stats"]["valid_groups"]


@pytest.mark.slow
def test_default_run_completes_and_the_reward_rises(tmp_path, caplog):
    """`python train_ar.py`'s own call, in process, shortened to 20 steps (evaluating every 10) for the
    suite's time."""
    args = [f"trainer.output_dir={tmp_path}", "trainer.num_steps=20", "eval.every_n_steps=10"]
    with caplog.at_level("INFO", logger="glm_training"):
        assert run("ar", "ar_training", args) == 0
    # The policy trained is the pipeline's own sampling distribution, logged once.
    line = "AR sampling: temperature=0.9 top_p=0.75 top_k=50 (from the pipeline's generation config)"
    assert [r.getMessage() for r in caplog.records].count(line) == 1
    rows = read_metrics(tmp_path / "metrics.jsonl")
    rewards = np.array([r["reward_mean"] for r in rows])
    assert len(rows) == 20
    # In 20 steps the run gains +1.48, +2.23, +1.88, +1.25, +1.30 (kB of JPEG, from about -52.4; trainer.seed
    # 0-4 under the pinned numerics, benchmarks/learning_margins.py ar) with a per-step noise of ~0.1-0.2.
    assert rewards[-5:].mean() - rewards[:5].mean() > 0.8, rewards.round(3).tolist()
    # The held-out evaluation (deterministic sampling, before training and every 10 steps) gains too.
    evals = {
        int(p.stem): json.loads(p.read_text())["reward_mean"] for p in (tmp_path / "eval").glob("*.json")
    }
    assert sorted(evals) == [0, 10, 20]
    # Measured (seeds 0-4, pinned): +1.65, +2.84, +2.82, +2.06, +1.43.
    assert evals[20] - evals[0] > 1.0, evals


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sampling.decoding=generate", "sampling.compile=true"], "sampling.compile"),  # the loop compiles
        (["sampling.static_cache=true"], "sampling.static_cache"),  # the loop always preallocates
        (["sampling.decoding=beam"], "sampling.decoding"),
        (["algo.importance_sampling_level=seq"], "algo.importance_sampling_level"),
        (["algo.min_group_std=-0.1"], "algo.min_group_std"),
        (["sampling.top_p=0"], "sampling.top_p"),
    ],
)
def test_bad_issue14_settings_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(overrides, "ar_training")
    assert err.value.key == key


def test_sampling_knobs_default_to_the_pipelines_own():
    cfg = load_config([], "ar_training")
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k) == (None, None, None)
    assert cfg.sampling.decoding == "loop" and not cfg.sampling.static_cache and not cfg.sampling.compile
    assert cfg.algo.importance_sampling_level == "token" and cfg.algo.min_group_std == 0.0


def test_verl_loss_options_train(tmp_path):
    # The dual clip, the log-ratio clamp and the low-variance KL reach the AR loss (two mini-batches, so the
    # second is off-policy); the math is golden-tested in tests/test_losses.py.
    verl = [
        "algo.clip_ratio_c=3.0",
        "algo.log_ratio_clamp=20",
        "algo.kl_low_var_clamp=true",
        "algo.beta=0.04",
    ]
    args = [*AR_SMALL, *verl, "algo.micro_batch_size=1", "algo.num_mini_batches=2", "trainer.num_steps=1"]
    assert run(ARTrainer, "ar_training", [*args, f"trainer.output_dir={tmp_path}"]) == 0
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert np.isfinite(row["loss"]) and row["grad_norm"] > 0

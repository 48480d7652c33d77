"""The prior-token cache (`python -m glm_training.priors`, `data.prior_cache`): DiT training without AR.

One small cache is built once per module (2 training prompts x 2 rows, 2 held-out prompts, 32x32, one prompt
per shard) and reused: its tokens are checked against live AR sampling, a DiT step on it against a DiT step
on live priors, a resumed run against an uninterrupted one, a 2-rank build against it, and every way a cache
can fail to fit a run against an exit with status 2 before the DiT loads.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DIT_SMALL, PYTHON, REPO, assert_resumed_run_matches, run_cli, torchrun
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.config import load_config
from glm_training.engine.trainer import DiTTrainer
from glm_training.metrics import read_metrics
from glm_training.pipeline.dit import generate_prior_tokens, prompt_seed
from glm_training.priors import (
    MANIFEST_FILE,
    PLAN_FILE,
    SHARD_DIR,
    PriorCache,
    build_cache,
    cache_settings,
    choose_row,
    finish_manifest,
    plan_shards,
    row_seed,
    write_shard,
)

PROMPTS = ["a red cube on a table", "a lighthouse at dusk"]
EVAL = ["eval.num_prompts=2"]
NUM_PRIORS = 2


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "train.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def small_args(prompt_file: Path) -> list[str]:
    return [*DIT_SMALL, f"data.prompt_file={prompt_file}", *EVAL]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, prompt_file) -> Path:
    out = tmp_path_factory.mktemp("cache") / "priors"
    cfg = load_config(small_args(prompt_file), "t2i_training")
    build_cache(cfg, out, num_priors=NUM_PRIORS, shard_size=1)
    return out


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    ar = pipe.vision_language_encoder
    ar.generation_config.pad_token_id = ar.generation_config.pad_token_id or ar.generation_config.eos_token_id
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_cached_tokens_are_the_live_tokens_of_the_same_prompt_seed_and_step(cache_dir, pipeline):
    cache = PriorCache(cache_dir)
    assert cache.num_rows == NUM_PRIORS and sorted(cache.index["train"]) == sorted(PROMPTS)
    for text in PROMPTS:
        rows = [cache.tokens("train", text, r) for r in range(NUM_PRIORS)]
        for r, cached in enumerate(rows):
            live = generate_prior_tokens(pipeline, [text], 32, 32, seed=row_seed(0, text, r))[0]
            assert cached.dtype == torch.int64 and torch.equal(cached, live), (text, r)
        assert not torch.equal(rows[0], rows[1])  # the rows are different samples
    # What a step decodes: the row chosen from (seed, step, group, prompt), live-sampled from its seed.
    for step in range(2):
        tokens = cache.step_tokens(PROMPTS, seed=0, step=step)
        for g, text in enumerate(PROMPTS):
            seed = row_seed(0, text, choose_row(0, step, g, text, NUM_PRIORS))
            assert torch.equal(tokens[g], generate_prior_tokens(pipeline, [text], 32, 32, seed=seed)[0])
    # Held-out prompts: the tokens the evaluation samples live (its seed per prompt, eval resolution).
    texts = list(cache.index["eval"])
    live = torch.cat([generate_prior_tokens(pipeline, [t], 32, 32, seed=prompt_seed(0, t)) for t in texts])
    assert torch.equal(cache.eval_tokens(texts), live)


def test_row_choice_depends_on_seed_step_group_and_prompt_only():
    picks = [choose_row(0, step, 0, "a", 8) for step in range(40)]
    assert picks == [choose_row(0, step, 0, "a", 8) for step in range(40)]
    assert len(set(picks)) > 4  # spread over the rows
    assert picks != [choose_row(1, step, 0, "a", 8) for step in range(40)]
    assert picks != [choose_row(0, step, 0, "b", 8) for step in range(40)]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def test_a_dit_step_on_cached_priors_equals_one_on_live_priors_with_those_tokens(tmp_path, prompt_file):
    args = [*small_args(prompt_file), "eval.every_n_steps=0", "trainer.num_steps=1"]
    cfg = load_config([*args, f"trainer.output_dir={tmp_path / 'probe'}"], "t2i_training")
    # The tokens the live AR stage gives step 0's groups ...
    probe = DiTTrainer(cfg)
    groups, _ = probe.collector.step_samples(0)
    live = probe.algorithm.decoder.shared_prior_tokens(groups, 0)
    assert sorted(p.text for p in groups) == sorted(PROMPTS)
    # ... written as a one-row cache (so the cached run must decode exactly them).
    from glm_training.frozen_weights import component_fingerprint

    fingerprint, weights = component_fingerprint(cfg.model, "ar")
    settings = cache_settings(cfg, num_priors=1, seed=0, fingerprint=fingerprint, weights=weights)
    cache = tmp_path / "cache"
    by_text = {p.text: live[g : g + 1] for g, p in enumerate(groups)}
    shards = [s for s in plan_shards(PROMPTS, [], settings, 1)]
    for shard in shards:
        write_shard(cache, shard, by_text[shard.texts[0]])
    finish_manifest(cache, settings, shards)

    assert run(DiTTrainer, "t2i_training", [*args, f"trainer.output_dir={tmp_path / 'live'}"]) == 0
    cached_args = [*args, f"trainer.output_dir={tmp_path / 'cached'}", f"data.prior_cache={cache}"]
    assert run(DiTTrainer, "t2i_training", cached_args) == 0
    a, b = _weights(tmp_path / "live", 1), _weights(tmp_path / "cached", 1)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    (x,), (y,) = (
        read_metrics(tmp_path / "live" / "metrics.jsonl"),
        read_metrics(tmp_path / "cached" / "metrics.jsonl"),
    )
    assert (
        x["reward_mean"] == y["reward_mean"] and x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]
    )


def test_resume_with_a_cache_is_bit_exact(tmp_path, prompt_file, cache_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [
        *small_args(prompt_file),
        "eval.every_n_steps=2",
        "trainer.save_every=2",
        f"data.prior_cache={cache_dir}",
    ]
    assert run(DiTTrainer, "t2i_training", [*args, "trainer.num_steps=4", f"trainer.output_dir={full}"]) == 0
    assert run(DiTTrainer, "t2i_training", [*args, "trainer.num_steps=2", f"trainer.output_dir={part}"]) == 0
    resume = [*args, "trainer.num_steps=4", f"trainer.output_dir={part}", "trainer.resume=latest"]
    assert run(DiTTrainer, "t2i_training", resume) == 0
    assert_resumed_run_matches(full, part, 4)
    # The cached evaluation ran (before training and every 2 steps) on the held-out prompts.
    assert sorted(p.name for p in (full / "eval").glob("*.json")) == [
        "000000.json",
        "000002.json",
        "000004.json",
    ]


@pytest.mark.slow
def test_the_ar_model_is_never_constructed_in_a_cached_run(tmp_path, prompt_file, cache_dir):
    """A process in which constructing the AR class raises trains and evaluates on the cache."""
    script = str(REPO / "tests" / "scripts" / "train_dit_without_ar.py")
    args = [*small_args(prompt_file), "trainer.num_steps=1", "eval.every_n_steps=1"]
    cached = run_cli(
        [PYTHON, script, *args, f"trainer.output_dir={tmp_path / 'c'}", f"data.prior_cache={cache_dir}"],
        timeout=300,
    )
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "[load] vision_language_encoder: not loaded (prior tokens from data.prior_cache=" in cached.stderr
    assert (tmp_path / "c" / "eval" / "000001.json").is_file()
    # The guard bites: the same process without the cache dies constructing the AR model.
    live = run_cli([PYTHON, script, *args, f"trainer.output_dir={tmp_path / 'l'}"], timeout=300)
    assert live.returncode != 0 and "GlmImageForConditionalGeneration constructed" in live.stderr


def _corrupt(cache: Path) -> None:
    shard = cache / SHARD_DIR / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit of one token
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("change", "args", "needle"),
    [
        (None, ["sampling.height=64", "sampling.width=64"], "holds priors for 32x32 images"),
        (None, ["model.tiny_seed=1"], "was made by other AR weights"),
        ("extra_prompt", [], "lacks 1 of the 3 training prompts"),
        (None, ["eval.seed=1"], "eval.seed: cache 0 vs run 1"),
        ("corrupt", [], "train-00001.safetensors does not match its sha256"),
        ("unfinished", [], "not a finished prior cache"),
    ],
    ids=["resolution", "ar-weights", "prompt-missing", "eval-seed", "corrupted", "unfinished"],
)
def test_a_cache_that_does_not_fit_is_refused_before_the_dit_loads(
    tmp_path, prompt_file, cache_dir, change, args, needle, caplog, capsys
):
    cache, prompts = cache_dir, prompt_file
    if change == "extra_prompt":
        prompts = tmp_path / "more.txt"
        prompts.write_text(prompt_file.read_text() + "a third prompt\n")
    elif change in ("corrupt", "unfinished"):
        cache = tmp_path / "copy"
        shutil.copytree(cache_dir, cache)
        _corrupt(cache) if change == "corrupt" else (cache / MANIFEST_FILE).unlink()
    full = [
        *small_args(prompts),
        "eval.every_n_steps=1",
        *args,
        f"data.prior_cache={cache}",
        f"trainer.output_dir={tmp_path / 'out'}",
    ]
    with caplog.at_level(logging.INFO):
        assert run(DiTTrainer, "t2i_training", full) == 2
    assert needle in capsys.readouterr().err
    assert not [r for r in caplog.records if "[load]" in r.getMessage()]


def test_a_finished_cache_is_never_overwritten_and_an_unfinished_one_resumes(
    tmp_path, prompt_file, cache_dir
):
    from glm_training.priors import main

    cfg_args = ["--config", str(REPO / "configs" / "t2i_training.yaml"), *small_args(prompt_file)]
    manifest = (cache_dir / MANIFEST_FILE).read_bytes()
    assert main([*cfg_args, "--output", str(cache_dir), "--shard-size", "1"]) == 2
    assert (cache_dir / MANIFEST_FILE).read_bytes() == manifest

    # A build cut short: one shard and the manifest missing. The rerun makes only what is missing.
    copy = tmp_path / "copy"
    shutil.copytree(cache_dir, copy)
    (copy / MANIFEST_FILE).unlink()
    (copy / SHARD_DIR / "train-00001.safetensors").unlink()
    kept = copy / SHARD_DIR / "train-00000.safetensors"
    kept_stat = kept.stat().st_mtime_ns
    rerun = [
        *cfg_args,
        "--output",
        str(copy),
        "--shard-size",
        "1",
        "--num-priors-per-prompt",
        str(NUM_PRIORS),
    ]
    # Other settings than the unfinished build's are refused, naming the difference.
    assert main([*rerun[:-1], "3"]) == 2
    assert main(rerun) == 0
    assert kept.stat().st_mtime_ns == kept_stat
    assert json.loads((copy / MANIFEST_FILE).read_text()) == json.loads(manifest)
    assert (copy / PLAN_FILE).is_file() and not list((copy / SHARD_DIR).glob(".*tmp"))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_rank_build_equals_a_one_rank_build(tmp_path, prompt_file, cache_dir):
    out = tmp_path / "two"
    args = [
        "glm_training.priors",
        "--config",
        str(REPO / "configs" / "t2i_training.yaml"),
        "--output",
        str(out),
        "--shard-size",
        "1",
        "--num-priors-per-prompt",
        str(NUM_PRIORS),
        *small_args(prompt_file),
    ]
    result = torchrun("-m", args, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 1: 2 to do" in result.stderr or "rank 0: 2 to do" in result.stderr
    assert json.loads((out / MANIFEST_FILE).read_text()) == json.loads(
        (cache_dir / MANIFEST_FILE).read_text()
    )
    names = sorted(p.name for p in (cache_dir / SHARD_DIR).iterdir())
    assert names == sorted(p.name for p in (out / SHARD_DIR).iterdir()) and len(names) == 4
    for name in names:
        assert (out / SHARD_DIR / name).read_bytes() == (cache_dir / SHARD_DIR / name).read_bytes(), name


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_in_step_on_the_cache(tmp_path, prompt_file, cache_dir):
    # 3 groups x 2 generations over 2 ranks: group 1 straddles them and must decode the same cached row.
    args = [
        str(tmp_path),
        *small_args(prompt_file),
        "data.num_groups_per_step=3",
        "data.num_generations=2",
        f"data.prior_cache={cache_dir}",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    result = torchrun(str(REPO / "tests" / "scripts" / "dist_dit_check.py"), args, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("[load] vision_language_encoder: not loaded") >= 1
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["group_ids"] == [0, 0, 1] and r1["group_ids"] == [1, 2, 2]
    assert r0["prior_tokens"][2] == r1["prior_tokens"][0]
    assert r0["approx_kl"] == 0.0 and r1["approx_kl"] == 0.0
    assert r0["checksum_after_step"] == r1["checksum_after_step"]

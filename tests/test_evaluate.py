"""Evaluation (in training and standalone), W&B offline logging, reward scoring that overlaps the rollout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DIT_SMALL, PYTHON, REPO, run_cli

from glm_training.cli import run
from glm_training.engine.trainer import ARTrainer, DiTTrainer
from glm_training.evaluate import main as evaluate_main
from glm_training.metrics import read_metrics
from glm_training.rewards.ocr import normalized_edit_distance, word_accuracy

SMALL = [*DIT_SMALL, "logging.images_every_n_steps=0"]
EVAL = ["eval.num_prompts=3", "eval.batch_size=2"]


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory) -> Path:
    """Two steps of a small DiT run with EMA and an evaluation (of the EMA weights) at steps 0 and 2, which
    also watches a reward it does not train on."""
    out = tmp_path_factory.mktemp("dit_eval_run")
    small = [a for a in SMALL if not a.startswith("eval.every_n_steps")]
    args = [*small, *EVAL, "trainer.num_steps=2", "eval.every_n_steps=2", f"trainer.output_dir={out}"]
    # An EMA update at each of the two steps (Flow-GRPO's own updates every 8th step).
    ema = ["algo.ema=true", "algo.ema_update_interval=1", "algo.ema_calls=per_optimizer_step"]
    args += [*ema, "eval.watch_rewards=[jpeg_incompressibility]"]
    assert run(DiTTrainer, "t2i_training", args) == 0
    return out


def _eval_numbers(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {"mean": data["reward_mean"], "per_prompt": data["rewards"]["jpeg_compressibility"]["per_prompt"]}


def test_standalone_evaluation_is_deterministic_and_matches_training(dit_run, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert evaluate_main(["--checkpoint", str(dit_run), "--output", str(first)]) == 0
    assert evaluate_main(["--checkpoint", str(dit_run), "--output", str(second)]) == 0
    a, b = _eval_numbers(first / "000002.json"), _eval_numbers(second / "000002.json")
    assert a == b  # bit for bit
    assert len(a["per_prompt"]) == 3 and len(set(a["per_prompt"])) == 3  # three different images
    # The same (EMA) weights and settings inside the training run gave the same numbers.
    assert _eval_numbers(dit_run / "eval" / "000002.json") == a
    # The watched reward (from the run's config.yaml) too.
    watched = [
        json.loads(p.read_text())["watched"] for p in (first / "000002.json", dit_run / "eval/000002.json")
    ]
    assert watched[0] == watched[1]
    # --no-ema evaluates the live weights instead, which differ from their EMA.
    live = tmp_path / "live"
    assert evaluate_main(["--checkpoint", str(dit_run), "--output", str(live), "--no-ema"]) == 0
    assert _eval_numbers(live / "000002.json") != a
    assert (first / "000002.png").is_file()
    # The base model evaluated standalone reproduces the run's step-0 evaluation.
    base = tmp_path / "base"
    overrides = [a for a in SMALL + EVAL if not a.startswith("trainer.")]
    assert evaluate_main(["--config", "configs/t2i_training.yaml", "--output", str(base), *overrides]) == 0
    assert _eval_numbers(base / "000000.json") == _eval_numbers(dit_run / "eval" / "000000.json")
    # And the training changed the weights enough to change the evaluation.
    assert _eval_numbers(dit_run / "eval" / "000000.json") != a


def test_a_dit_runs_evaluation_writes_each_prompts_prior_tokens_once(tiny_model_dir):
    """The AR model does not train in a DiT run, so its tokens for a held-out prompt are the same at every
    evaluation: generated at the first, kept for the later ones (the run's later evaluations equal standalone
    ones, which generate anew: the test above)."""
    import torch
    from diffusers import GlmImagePipeline

    from glm_training.evaluation import EvalSampling, FrozenPriors
    from glm_training.pipeline.dit import generate_prior_tokens, prompt_seed

    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    sampling = EvalSampling(
        height=32, width=32, num_inference_steps=2, guidance_scale=1.0, seed=7, batch_size=2
    )
    priors, calls, generate = FrozenPriors(pipe, sampling), [], pipe.generate_prior_tokens

    def counted(**kwargs):
        calls.append(kwargs["prompt"])
        return generate(**kwargs)

    pipe.generate_prior_tokens = counted
    first = priors.eval_tokens(["a cat", "a dog"])
    later = priors.eval_tokens(["a dog", "a cat", "a cow"])
    assert calls == [["a cat"], ["a dog"], ["a cow"]]  # one AR call per prompt, ever
    assert torch.equal(later[:2], first.flip(0))
    for text, tokens in zip(["a dog", "a cat", "a cow"], later):
        alone = generate_prior_tokens(pipe, [text], 32, 32, seed=prompt_seed(7, text))
        assert torch.equal(tokens, alone[0])  # what an evaluation without them samples


def test_watched_reward_is_reported_apart_from_the_trained_one(dit_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    means = {}
    for step in (0, 2):
        data = json.loads((dit_run / "eval" / f"{step:06d}.json").read_text())
        trained = data["rewards"]["jpeg_compressibility"]
        # The total is the trained reward's alone, as without a watched reward.
        assert list(data["rewards"]) == ["jpeg_compressibility"]
        assert data["total_per_prompt"] == trained["per_prompt"] and data["reward_mean"] == trained["mean"]
        # Incompressibility is +kB, compressibility -kB of the same images' JPEGs.
        (watched,) = data["watched"].values()
        assert list(data["watched"]) == ["jpeg_incompressibility"]
        assert watched["per_prompt"] == [-x for x in trained["per_prompt"]]
        assert watched["mean"] == pytest.approx(-trained["mean"], rel=1e-6)
        means[step] = watched["mean"]
    events = EventAccumulator(str(dit_run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = events.Scalars("eval/watched/jpeg_incompressibility")
    assert [e.step for e in logged] == [0, 2]
    assert [e.value for e in logged] == pytest.approx([means[0], means[2]], rel=1e-6)
    assert read_metrics(dit_run / "metrics.jsonl")[-1]["eval/watched/jpeg_incompressibility"] == means[2]


def test_standalone_text_metrics_compare_the_recognised_text(tmp_path, capsys):
    prompt_file = tmp_path / "text.jsonl"
    rows = [
        {"prompt": "a shop sign at night", "text": "Open  LATE"},
        {"prompt": 'a mug printed with "GLM cafe"'},
        {"prompt": "a cat on a mat"},  # no text: left out of the text metrics
    ]
    prompt_file.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    overrides = [a for a in SMALL if not a.startswith("trainer.")]
    overrides += ["eval.batch_size=2", f"eval.prompt_file={prompt_file}", "eval.text_metrics=true"]
    out = tmp_path / "out"
    assert evaluate_main(["--config", "configs/t2i_training.yaml", "--output", str(out), *overrides]) == 0
    data = json.loads((out / "000000.json").read_text())
    text = data["text_metrics"]
    assert (text["num_with_text"], text["num_without_text"]) == (2, 1)
    *scored, skipped = text["per_prompt"]
    assert skipped is None and [r["target"] for r in scored] == ["open late", "glm cafe"]
    # Tiny random weights draw no legible text, so the numbers are those of whatever RapidOCR read.
    for r in scored:
        assert r["word_accuracy"] == word_accuracy(r["recognised"], r["target"])
        assert r["normalized_edit_distance"] == normalized_edit_distance(r["recognised"], r["target"])
    assert text["word_accuracy"] == pytest.approx(sum(r["word_accuracy"] for r in scored) / 2)
    assert text["normalized_edit_distance"] == pytest.approx(
        sum(r["normalized_edit_distance"] for r in scored) / 2
    )
    scalars = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert scalars["eval/text/word_accuracy"] == text["word_accuracy"]
    assert scalars["eval/text/ned"] == text["normalized_edit_distance"]
    assert "watched" not in data and (out / "000000.png").is_file()


def test_rank_batches_deal_whole_batches():
    from glm_training.evaluation import rank_batches

    # 7 prompts in batches of 3: [0, 1, 2], [3, 4, 5], [6]; two ranks take batches 0, 2 and 1.
    assert rank_batches(7, 3, 0, 2) == [[0, 1, 2], [6]]
    assert rank_batches(7, 3, 1, 2) == [[3, 4, 5]]
    assert rank_batches(2, 3, 1, 2) == []  # a rank with nothing to do still joins the gather


def test_evaluation_overrides_change_the_result(dit_run, tmp_path):
    assert evaluate_main(["--checkpoint", str(dit_run), "--output", str(tmp_path), "eval.seed=7"]) == 0
    seeded = json.loads((tmp_path / "000002.json").read_text())
    assert seeded["sampling"]["seed"] == 7
    assert _eval_numbers(tmp_path / "000002.json") != _eval_numbers(dit_run / "eval" / "000002.json")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--checkpoint", "{tmp}"], "is neither a checkpoint folder"),
        (["--config", "configs/t2i_training.yaml", "eval.prompt_file={tmp}/empty.txt"], "holds no prompts"),
        (["--config", "configs/t2i_training.yaml", "eval.batch_sise=2"], "Did you mean 'eval.batch_size'"),
        (["--config", "configs/t2i_training.yaml", "--checkpoint", "{tmp}"], "not both"),
    ],
    ids=["not-a-checkpoint", "empty-prompts", "typo", "both"],
)
def test_standalone_bad_input(tmp_path, args, needle):
    (tmp_path / "empty.txt").write_text("\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = run_cli([PYTHON, "-m", "glm_training.evaluate", *args], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_overlapped_scoring_gives_the_same_run(tmp_path):
    runs = {}
    for overlap in ("false", "true"):
        out = tmp_path / overlap
        args = [*SMALL, "trainer.num_steps=2", "sampling.micro_batch_size=2", f"reward.overlap={overlap}"]
        assert run(DiTTrainer, "t2i_training", [*args, f"trainer.output_dir={out}"]) == 0
        runs[overlap] = read_metrics(out / "metrics.jsonl")
    keys = ("reward_mean", "reward_std", "loss", "grad_norm")
    assert [[r[k] for k in keys] for r in runs["true"]] == [[r[k] for k in keys] for r in runs["false"]]


def test_normalized_sum_of_two_rewards(tmp_path):
    args = [
        *SMALL,
        "trainer.num_steps=1",
        f"trainer.output_dir={tmp_path}",
        "reward.names=[jpeg_compressibility,jpeg_incompressibility]",
        "reward.weights=[1.0,0.5]",
        "reward.combine=normalized_sum",
    ]
    assert run(DiTTrainer, "t2i_training", args) == 0
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    # incompressibility = -compressibility, so its z-scores are the negatives: total = (1 - 0.5) * z_comp,
    # whose group means are 0 and whose population std within each group is 0.5 * std / (std + eps): the
    # JPEG sizes of 32x32 images differ by ~0.01 kB within a group, so eps = 1e-4 takes up to ~1% off.
    assert row["reward_mean"] == pytest.approx(0.0, abs=1e-5)
    assert 0.49 < row["reward_std"] <= 0.5
    assert row["reward/jpeg_compressibility"] == pytest.approx(-row["reward/jpeg_incompressibility"])


def test_ar_run_with_evaluation_overlap_and_wandb_offline(tmp_path):
    out = tmp_path / "ar"
    args = [
        "trainer.progress_bar=false",
        "sampling.height=32",
        "sampling.width=32",
        "sampling.dit_num_steps=2",
        "data.num_groups_per_step=2",
        "data.num_generations=2",
        "algo.micro_batch_size=2",
        "trainer.num_steps=1",
        "reward.overlap=true",
        "eval.every_n_steps=1",
        *EVAL,
        "logging.images_every_n_steps=1",
        "logging.wandb=true",
        "logging.wandb_mode=offline",
        f"trainer.output_dir={out}",
    ]
    result = run_cli([PYTHON, str(REPO / "train_ar.py"), *args], timeout=300, env={"WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (out / "eval").glob("*.json")) == ["000000.json", "000001.json"]
    (row,) = read_metrics(out / "metrics.jsonl")
    assert "eval/reward_mean" in row and "eval/reward/jpeg_compressibility" in row
    (run_folder,) = (out / "wandb").glob("offline-run-*")
    assert list(run_folder.glob("run-*.wandb"))
    media = run_folder / "files" / "media" / "images"
    assert list((media / "train").glob("*.png")) and list((media / "eval").glob("*.png"))
    assert (
        ARTrainer.component
        == json.loads(next((out / "checkpoints").iterdir()).joinpath("trainer_state.json").read_text())[
            "component"
        ]
    )


@pytest.mark.parametrize(
    ("num_prompts", "batch_size", "world_size"), [(3, 2, 2), (10, 4, 2), (5, 8, 4), (7, 1, 3)]
)
def test_equal_calls_give_every_rank_the_same_batches_and_score_each_prompt_once(
    num_prompts, batch_size, world_size
):
    from glm_training.evaluation import _rank_work

    work = [_rank_work(num_prompts, batch_size, r, world_size, True) for r in range(world_size)]
    shapes = {tuple(len(batch) for batch, _ in w) for w in work}
    assert len(shapes) == 1  # the same number of batches of the same sizes: the same forward calls
    scored = sorted(i for w in work for batch, n in w for i in batch[:n])
    assert scored == list(range(num_prompts))
    plain = [_rank_work(num_prompts, batch_size, r, world_size, False) for r in range(world_size)]
    assert sorted(i for w in plain for batch, n in w for i in batch[:n]) == scored

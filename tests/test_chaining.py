"""Chaining the decoupled stages: `model.ar_weights` (DiT trainer, priors command), `model.dit_weights` (AR
trainer), from a run, a checkpoint or an export, LoRA or full; checked against export's own readers."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glm_training.cli import run
from glm_training.config import load_config
from glm_training.engine.trainer import ARTrainer, DiTTrainer
from glm_training.evaluate import main as evaluate_main
from glm_training.export import export, load_pipeline_from_checkpoints
from glm_training.pipeline.dit import generate_prior_tokens
from glm_training.priors import PriorCache, build_cache, row_seed

COMMON = [
    "trainer.progress_bar=false",
    "sampling.height=32",
    "sampling.width=32",
    "data.num_groups_per_step=2",
    "data.num_generations=2",
    "trainer.num_steps=1",
    "eval.every_n_steps=0",
    "eval.num_prompts=1",
]
DIT = [*COMMON, "sampling.num_steps=2"]
AR = [*COMMON, "sampling.dit_num_steps=1", "algo.micro_batch_size=4", "algo.dynamic_sampling=false"]
# One Adam step moves every weight by about lr: a large lr makes one step visible.
FULL = ["model.lora.enabled=false", "optim.lr=0.05"]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.1"]


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory) -> str:
    """A 2-prompt file: the priors command then makes 2 rows, not one per bundled prompt."""
    path = tmp_path_factory.mktemp("prompts") / "two.txt"
    path.write_text("a red cube on a table\na lighthouse at dusk\n")
    return f"data.prompt_file={path}"


def _train(tmp_path_factory, name, trainer_cls, config, args) -> Path:
    out = tmp_path_factory.mktemp(name)
    assert run(trainer_cls, config, [*args, f"trainer.output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def ar_full_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "ar_full", ARTrainer, "ar_training", [*AR, *FULL])


@pytest.fixture(scope="module")
def ar_lora_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "ar_lora", ARTrainer, "ar_training", [*AR, *LORA])


@pytest.fixture(scope="module")
def dit_full_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "dit_full", DiTTrainer, "t2i_training", [*DIT, *FULL])


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_priors_from_an_ar_run_are_the_trained_ar_tokens(tmp_path, kind, request, two_prompts):
    ar_run = request.getfixturevalue(f"ar_{kind}_run")
    dit = [*DIT, two_prompts]
    cfg = load_config([*dit, f"model.ar_weights={ar_run}"], "t2i_training")
    cache_dir = build_cache(cfg, tmp_path / "priors", num_priors=1)
    # Export's reader, peft's merge for LoRA: the AR model an export of the run holds.
    trained = load_pipeline_from_checkpoints([ar_run])
    cache = PriorCache(cache_dir)
    trained.set_progress_bar_config(disable=True)
    for text in cache.index["train"]:
        live = generate_prior_tokens(trained, [text], 32, 32, seed=row_seed(0, text, 0))[0]
        assert torch.equal(cache.tokens("train", text, 0), live), text
    assert cache.settings["ar_weights"]["weights"].startswith("model.ar_weights: ar checkpoint step 1")

    if kind == "lora":
        return  # the runs below read the cache the same way whatever kind of checkpoint made it
    # The cache's fingerprint is the trained AR's: a DiT run that names the base AR is refused before
    # loading, one that names the AR run trains on it.
    base_run = [*dit, f"data.prior_cache={cache_dir}", f"trainer.output_dir={tmp_path / 'a'}"]
    assert run(DiTTrainer, "t2i_training", base_run) == 2
    chained = [*dit, f"data.prior_cache={cache_dir}", f"model.ar_weights={ar_run}", "eval.every_n_steps=1"]
    assert run(DiTTrainer, "t2i_training", [*chained, f"trainer.output_dir={tmp_path / 'b'}"]) == 0
    # Its evaluation ran on the cached held-out tokens; a standalone evaluation of the checkpoint samples
    # them live with model.ar_weights, and gets the same numbers.
    assert evaluate_main(["--checkpoint", str(tmp_path / "b"), "--output", str(tmp_path / "e")]) == 0
    during = json.loads((tmp_path / "b" / "eval" / "000001.json").read_text())
    standalone = json.loads((tmp_path / "e" / "000001.json").read_text())
    assert during["rewards"] == standalone["rewards"] and during["prompts"] == standalone["prompts"]


def test_live_dit_run_samples_with_the_trained_ar_and_ar_run_renders_with_the_trained_dit(
    tmp_path, tiny_model_dir, ar_full_run, dit_full_run
):
    from diffusers import GlmImagePipeline

    trained_ar = load_pipeline_from_checkpoints([ar_full_run]).vision_language_encoder
    cfg = load_config(
        [*DIT, f"model.ar_weights={ar_full_run}", f"trainer.output_dir={tmp_path / 'dit'}"], "t2i_training"
    )
    dit = DiTTrainer(cfg)
    _assert_same(_params(dit.policy.wrapper.pipeline.vision_language_encoder), _params(trained_ar))
    base_ar = GlmImagePipeline.from_pretrained(tiny_model_dir).vision_language_encoder
    assert any(not torch.equal(a, b) for a, b in zip(_params(base_ar).values(), _params(trained_ar).values()))

    # The AR trainer's frozen DiT: the DiT run's weights, from the run folder and from its export alike.
    trained_dit = load_file(
        str(sorted((dit_full_run / "checkpoints").iterdir())[-1] / "trainable.safetensors")
    )
    exported = export([dit_full_run], tmp_path / "export")
    for source in (dit_full_run, exported):
        args = [*AR, f"model.dit_weights={source}", f"trainer.output_dir={tmp_path / ('ar-' + source.name)}"]
        ar = ARTrainer(load_config(args, "ar_training"))
        params = dict(ar.policy.wrapper.pipeline.transformer.named_parameters())
        for name, value in trained_dit.items():
            assert torch.equal(params[name].detach(), value), (source, name)
        assert not any(p.requires_grad for p in params.values())


@pytest.mark.parametrize(
    ("trainer", "config", "args", "needle"),
    [
        (DiTTrainer, "t2i_training", ["model.dit_weights=RUN_AR"], "this run trains the dit"),
        (DiTTrainer, "t2i_training", ["model.ar_weights=RUN_DIT"], "holds a dit checkpoint"),
        (ARTrainer, "ar_training", ["model.dit_weights=RUN_AR"], "holds a ar checkpoint"),
        (DiTTrainer, "t2i_training", ["model.ar_weights=NOWHERE"], "model.ar_weights"),
        (
            DiTTrainer,
            "t2i_training",
            ["model.ar_weights=RUN_AR", "model.tiny_seed=1"],
            "trained from base model",
        ),
        (ARTrainer, "ar_training", ["data.prior_cache=NOWHERE"], "'data.prior_cache': is for train_dit.py"),
    ],
    ids=["trained-half", "dit-as-ar", "ar-as-dit", "missing", "other-base", "cache-for-ar"],
)
def test_weights_that_do_not_fit_are_refused_before_loading(
    tmp_path, ar_full_run, dit_full_run, trainer, config, args, needle, capsys, caplog
):
    paths = {"RUN_AR": str(ar_full_run), "RUN_DIT": str(dit_full_run), "NOWHERE": str(tmp_path / "none")}
    args = [a.split("=")[0] + "=" + paths.get(a.split("=")[1], a.split("=")[1]) for a in args]
    base = DIT if trainer is DiTTrainer else AR
    with caplog.at_level(logging.INFO):
        assert run(trainer, config, [*base, *args, f"trainer.output_dir={tmp_path / 'out'}"]) == 2
    assert needle in capsys.readouterr().err
    assert not [r for r in caplog.records if "[load] from_pretrained" in r.getMessage()]

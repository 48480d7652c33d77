"""The real-model recipes (`configs/recipes/`, `docs/recipes.md`) and the guard that keeps the tiny
quick-starts out of real-model runs.

- Each recipe composes (`--config-name recipes/<name>`) to the values its table in docs/recipes.md states,
  and the table lists every key the file sets: the doc and the files cannot drift apart.
- Each recipe names its schema and `model: glm_image` itself, never a quick-start config.
- Each recipe runs one step scaled down to the tiny model (sizes, group counts and the quick-start's learning
  rate; reward models swapped for tiny local weights), in this process; where a recipe takes several optimizer
  steps per rollout with a clipped ratio, the first is on-policy (clip fraction 0) and the clip acts on every
  later one (the AR recipes' done-when of issue 24).
- Training `zai-org/GLM-Image` from a quick-start config is refused, naming that algorithm's recipes.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO
from omegaconf import OmegaConf

from glm_training.build import build_trainer
from glm_training.cli import REAL_MODEL, check_not_quick_start, recipes_by_algorithm, run
from glm_training.config import (
    ALGORITHMS,
    CONFIG_DIR,
    ConfigError,
    algorithm_of,
    available_configs,
    compose_config,
    load_config,
    parse_command_line,
)
from glm_training.config.algorithms import JOINT_CONFIG, JOINT_SCHEMA
from glm_training.config.loading import RECIPE_DIR
from glm_training.metrics import read_metrics

RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
# The recipes of one half (train_dit.py, train_ar.py); test_joint_training.py trains the joint one.
HALF_RECIPES = [
    n for n in RECIPES if OmegaConf.load(RECIPE_DIR / f"{n}.yaml").defaults[0] != f"/{JOINT_SCHEMA}"
]
DOC = REPO / "docs" / "recipes.md"
# A table row of docs/recipes.md: | `key` | `value` | source |
ROW = re.compile(r"^\|\s*`([\w.]+)`\s*\|\s*`([^`]*)`\s*\|")
HEADING = re.compile(r"^#{2,4} ")


def _value(text: str) -> Any:
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 (PyYAML) reads 1e-5 as a string; OmegaConf reads a float
        except ValueError:
            return value
    return value


@functools.cache
def documented() -> dict[str, dict[str, Any]]:
    """{recipe: {key: value}} from the tables of docs/recipes.md, one per `recipes/<name>` heading."""
    tables: dict[str, dict[str, Any]] = {}
    current = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if HEADING.match(line):
            named = re.search(r"`recipes/(\w+)`", line)
            current = named.group(1) if named else None
            if current is not None:
                assert current not in tables, f"two sections for recipes/{current} in {DOC.name}"
                tables[current] = {}
        elif current is not None and (row := ROW.match(line)):
            tables[current][row.group(1)] = _value(row.group(2))
    return tables


def _keys_set_in(name: str) -> set[str]:
    """Every dotted key the recipe file itself sets (its defaults list aside)."""
    raw = OmegaConf.to_container(OmegaConf.load(RECIPE_DIR / f"{name}.yaml"))
    keys: set[str] = set()

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                keys.add(f"{prefix}{key}")

    walk({k: v for k, v in raw.items() if k != "defaults"}, "")
    return keys


def _get(cfg: Any, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def test_there_are_the_issue_24_recipes_and_each_is_listed():
    assert {
        "flow_grpo_fast_ocr",
        "flow_grpo_ocr",
        "flow_grpo_pickscore",
        "nft_pickscore",
        "nft_ocr",
        "dapo_aesthetic_alignment",
        "gspo_aesthetic_alignment",
    } <= set(RECIPES)
    assert {f"configs/recipes/{name}.yaml" for name in RECIPES} <= set(available_configs())
    by_algorithm = recipes_by_algorithm()
    listed = sorted(r for recipes in by_algorithm.values() for r in recipes)
    assert listed == [f"recipes/{n}" for n in RECIPES]
    assert {"flow_grpo", "nft", "grpo"} <= set(by_algorithm)


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_composes_to_the_values_its_doc_table_states(name):
    table = documented().get(name)
    assert table, f"docs/recipes.md has no table under a heading naming `recipes/{name}`"
    undocumented = _keys_set_in(name) - set(table)
    assert not undocumented, f"recipes/{name} sets keys its table in docs/recipes.md omits: {undocumented}"
    cfg = load_config(config=f"recipes/{name}")
    for key, value in table.items():
        assert _get(cfg, key) == value, f"recipes/{name}: {key} is {_get(cfg, key)!r}, the doc says {value!r}"


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_names_its_schema_and_the_real_model_not_a_quick_start(name):
    defaults = OmegaConf.to_container(OmegaConf.load(RECIPE_DIR / f"{name}.yaml").defaults)
    schemas = {f"/{algorithm.schema}" for algorithm in ALGORITHMS.values()} | {f"/{JOINT_SCHEMA}"}
    assert defaults[0] in schemas and defaults[1:] == [{"/model": "glm_image"}, "_self_"], defaults
    assert (RECIPE_DIR / f"{name}.yaml").read_text().startswith("# @package _global_\n")
    recipe = load_config(config=f"recipes/{name}")
    joint = recipe.component == "joint"
    quick_start = load_config(config=JOINT_CONFIG) if joint else None
    # A joint recipe: each half's run config holds that half's settings (`JointTrainConfig.half`).
    for half in ("ar", "dit") if joint else (None,):
        cfg = recipe.half(half) if joint else recipe
        assert (
            cfg.model.name == REAL_MODEL and cfg.model.lora.enabled and cfg.trainer.mixed_precision == "bf16"
        )
        assert (cfg.sampling.height, cfg.sampling.width) == (1024, 1024)
        # Nothing of the tiny quick-start's sizes or learning rate reaches the recipe.
        quick = quick_start.half(half) if joint else load_config(config=algorithm_of(cfg).config)
        assert cfg.optim.lr != quick.optim.lr and cfg.data.num_generations > quick.data.num_generations


def test_every_spelling_composes_the_same_recipe():
    name = "flow_grpo_ocr"
    configs = [
        load_config(["--config-name", f"recipes/{name}"]),
        load_config(["--config-name", f"recipes/{name}.yaml"]),
        load_config(["--config", f"configs/recipes/{name}.yaml"]),
        load_config(["--config", f"recipes/{name}"]),  # a path inside configs/, as `plan --config` takes it
        load_config(config=f"recipes/{name}"),
    ]
    assert all(c == configs[0] for c in configs[1:])
    assert load_config(config=f"recipes/{name}", overrides=["model=tiny"]).model.name == "tiny"


def test_a_config_in_a_subfolder_without_the_global_package_is_named(tmp_path):
    (tmp_path / "mine").mkdir()
    defaults = "defaults:\n  - /dit_schema\n  - /model: glm_image\n  - _self_\n"
    (tmp_path / "mine" / "run.yaml").write_text(defaults)
    args = ["--config-path", str(tmp_path), "--config-name", "mine/run"]
    command = parse_command_line(args, "t2i_training")
    with pytest.raises(ConfigError, match="# @package _global_"):
        compose_config(command)


# ---------------------------------------------------------------------------------------------------------
# The guard


QUICK_STARTS = [a for a in ALGORITHMS.values() if (CONFIG_DIR / f"{a.config}.yaml").is_file()]


@pytest.mark.parametrize("algorithm", QUICK_STARTS, ids=lambda a: a.config)
def test_a_quick_start_refuses_the_real_model_naming_its_recipes(algorithm):
    command = parse_command_line(["model=glm_image"], algorithm.config)
    with pytest.raises(ConfigError) as err:
        check_not_quick_start(compose_config(command), command)
    message = str(err.value)
    shipped = OmegaConf.load(CONFIG_DIR / f"{algorithm.config}.yaml")
    assert f"configs/{algorithm.config}.yaml holds the tiny model's sizes and learning rate" in message
    assert f"{shipped.sampling.height}x{shipped.sampling.width}" in message
    mantissa, _, exponent = f"{shipped.optim.lr:.0e}".partition("e")
    assert f"lr {mantissa}e{int(exponent)}" in message
    recipes = recipes_by_algorithm().get(algorithm.name, [])
    for recipe in recipes:
        assert f"--config-name {recipe}" in message
    if not recipes:
        assert f"no recipe trains {algorithm.name} yet" in message


def test_the_guard_spares_other_models_recipes_own_files_and_printing(tmp_path, capsys):
    def check(args: list[str], default: str = "t2i_training") -> None:
        command = parse_command_line(args, default)
        check_not_quick_start(compose_config(command), command)

    check(["model=tiny"])
    check(["model=glm_image_shape"], "ar_training")
    check(["--config-name", "recipes/flow_grpo_ocr"])
    own = tmp_path / "mine.yaml"  # a user's own copy is theirs to size
    shutil.copy(CONFIG_DIR / "t2i_training.yaml", own)
    check(["--config", str(own), "model=glm_image"])
    # Printing the config or the help loads nothing and trains nothing: allowed.
    assert run("dit", "t2i_training", ["model=glm_image", "--cfg", "job"]) == 0
    assert "zai-org/GLM-Image" in capsys.readouterr().out
    # The entry point refuses before anything loads, exit status 2, the recipes named.
    assert run("dit", "t2i_training", ["--config", "configs/nft_training.yaml", "model=glm_image"]) == 2
    assert "--config-name recipes/nft_pickscore" in capsys.readouterr().err
    assert run("ar", "ar_training", ["model=glm_image"]) == 2
    assert "--config-name recipes/dapo_aesthetic_alignment" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# One step of each recipe, scaled down to the tiny model


def _tiny_rewards(names: list[str], clip: Path) -> list[str]:
    """Rewards on tiny local weights. OCR scores the tiny model's random images 0 (no text, no group spread,
    nothing trains), so its one step uses the weight-free JPEG reward instead."""
    options = {
        "pickscore": {"model": clip, "processor": clip, "device": "cpu"},
        "clip_score": {"model": clip, "device": "cpu"},
        "aesthetic": {"clip_model": clip, "head": clip / "head.pth", "device": "cpu"},
    }
    swapped = ["jpeg_compressibility" if n == "ocr" else n for n in names]
    args = [f"reward.names=[{','.join(swapped)}]"]
    for name in swapped:
        args += [f"+reward.options.{name}.{key}={value}" for key, value in options.get(name, {}).items()]
    return args


def _scaled_down(name: str, clip: Path, output_dir: Path) -> Any:
    recipe = load_config(config=f"recipes/{name}")
    algorithm = algorithm_of(recipe)
    quick_start = OmegaConf.load(CONFIG_DIR / f"{algorithm.config}.yaml")
    half = {
        "dit": ["data.num_generations=2"],
        # 2 groups of 4 in micro-batches of 2: 4 micro-batches, one per mini-batch of the AR recipes.
        # The tiny model trains in full (no adapters to fold), and compiling costs a minute on a CPU; the
        # folded sampler has its own tests (test_ar_sampler.py, test_ar_training.py).
        "ar": [
            "data.num_generations=4",
            "sampling.dit_num_steps=1",
            "sampling.sampler=policy",
            "sampling.compile=false",
        ],
    }[algorithm.component]
    return load_config(
        config=f"recipes/{name}",
        overrides=[
            "model=tiny",
            "sampling.height=32",
            "sampling.width=32",
            "data.num_groups_per_step=2",
            "data.prompt_file=",
            f"optim.lr={quick_start.optim.lr}",  # the tiny model's full fine-tuning, not the recipe's LoRA lr
            "optim.warmup_steps=0",
            "trainer.num_steps=1",
            "trainer.progress_bar=false",
            f"trainer.output_dir={output_dir}",
            "eval.every_n_steps=0",
            "logging.tensorboard=false",
            "logging.images_every_n_steps=0",
            *half,
            *_tiny_rewards(list(recipe.reward.names), clip),
        ],
    )


@pytest.mark.parametrize("name", HALF_RECIPES)
def test_each_recipe_trains_one_step_scaled_down_and_its_clip_acts(name, tiny_clip, tmp_path):
    cfg = _scaled_down(name, tiny_clip, tmp_path)
    trainer = build_trainer(cfg, cfg.component)
    trainer.train()
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isfinite(row["loss"]) and math.isfinite(row["reward_mean"])
    minis = trainer.updates.last.mini_batches
    assert len(minis) == cfg.algo.num_mini_batches
    if "clip_frac" in minis[0] and len(minis) > 1:
        # The first optimizer step is on-policy (ratio exactly 1); on every later one the ratios moved. The
        # DiT's clip_frac counts every ratio outside the range (Flow-GRPO's), so it is > 0 on each later step;
        # the AR model's counts the clips that change the loss (verl's, TRL's), which a step may not meet.
        assert minis[0]["clip_frac"] == 0.0, minis[0]
        assert all(m["approx_kl"] > 0 for m in minis[1:]), minis
        later = [m["clip_frac"] > 0 for m in minis[1:]]
        assert all(later) if cfg.component == "dit" else any(later), [m["clip_frac"] for m in minis]

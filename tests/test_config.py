"""Configs: every YAML composes to the typed config; bad input exits non-zero naming the key, early."""

from __future__ import annotations

import pytest
from conftest import PYTHON, REPO, children_cpu_seconds, run_cli

from glm_training.config import (
    ALGORITHMS,
    ARTrainConfig,
    AWMTrainConfig,
    ConfigError,
    DiTTrainConfig,
    NFTTrainConfig,
    load_config,
)
from glm_training.config.algorithms import JOINT_CONFIG
from glm_training.config.joint import JointTrainConfig

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


def test_there_are_configs_for_both_trainers():
    assert {"t2i_training.yaml", "ar_training.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("model", ["tiny", "glm_image"])
@pytest.mark.parametrize("name", CONFIGS)
def test_every_yaml_composes_to_the_typed_config(name, model):
    cfg = load_config(["--config", f"configs/{name}", f"model={model}"], "t2i_training")
    # The table row whose tiny config this is names its run config.
    tables = {a.config: a.run_config for a in ALGORITHMS.values()} | {JOINT_CONFIG: JointTrainConfig}
    expected = tables[name.removesuffix(".yaml")]
    assert type(cfg) is expected
    assert {"ar": ARTrainConfig, "nft": NFTTrainConfig, "awm": AWMTrainConfig, "t2i": DiTTrainConfig}.get(
        name.split("_")[0], expected
    ) is expected
    assert cfg.model.name == ("tiny" if model == "tiny" else "zai-org/GLM-Image")
    assert (cfg.dit.sampling if expected is JointTrainConfig else cfg.sampling).height % 32 == 0


def test_both_spellings_give_the_same_config():
    a = load_config(["--config", "configs/t2i_training.yaml", "algo.beta=0.04"], "ar_training")
    b = load_config(["--config-name", "t2i_training", "algo.beta=0.04"], "ar_training")
    c = load_config(["--config-name=t2i_training", "algo.beta=0.04"], "ar_training")
    assert a == b == c
    assert a.algo.beta == 0.04


def test_a_config_file_outside_configs_still_finds_the_model_group(tmp_path):
    custom = tmp_path / "mine.yaml"
    custom.write_text("defaults:\n  - dit_schema\n  - model: glm_image\n  - _self_\nrun_name: mine\n")
    cfg = load_config(["--config", str(custom)], "t2i_training")
    assert cfg.run_name == "mine" and cfg.model.name == "zai-org/GLM-Image"


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("algo.clip_rnge=0.1", "algo.clip_rnge", "algo.clip_range"),
        ("modle.name=x", "modle", "model"),
        ("algo.beta=abc", "algo.beta", "could not be converted"),
        ("sampling.height=65", "sampling.height", "multiple of 32"),
        ("sampling.width=100", "sampling.width", "try 96"),
        ("sampling.sde_type=ddim", "sampling.sde_type", "flow_sde"),
        ("reward.weights=[1.0,2.0]", "reward.weights", "one per name"),
        ("model.device_map=gpu", "model.device_map", "'cuda'"),
        ("data.num_generations=1", "data.num_generations", ">= 2"),
        # A misspelt choice: the closest name and all of them (never another algorithm's config).
        ("algo.name=flow_grop", "algo.name", "did you mean 'flow_grpo'? the algorithms: flow_grpo, nft, awm"),
        ("model=tinyy", "model", "did you mean 'tiny'? the options: glm_image, glm_image_shape, tiny."),
        # TRL's / transformers' names for the common settings point to this project's.
        ("max_steps=3", "max_steps", "TRL's / transformers' 'max_steps' here: trainer.num_steps."),
        (
            "trainer.save_total_limit=2",
            "trainer.save_total_limit",
            "'save_total_limit' here: trainer.keep_last.",
        ),
        ("learning_rate=1e-5", "learning_rate", "'learning_rate' here: optim.lr."),
        ("report_to=wandb", "report_to", "'report_to' here: logging.tensorboard=true / logging.wandb=true."),
        ("logging_steps=10", "logging_steps", "'logging_steps' here: none, every step's metrics are logged"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(override, key, fix):
    with pytest.raises(ConfigError) as err:
        load_config([override], "t2i_training")
    assert err.value.key == key
    assert fix in str(err.value)


@pytest.mark.parametrize(
    ("config", "name", "fix"),
    [
        (
            "awm_training",
            "nft",
            "this config trains 'awm'; 'nft' has its own: train_dit.py --config configs/nft_training.yaml",
        ),
        ("t2i_training", "grpo", "'grpo' has its own: train_ar.py --config configs/ar_training.yaml"),
        (
            "ar_training",
            "flow_grpo",
            "'flow_grpo' has its own: train_dit.py --config configs/t2i_training.yaml",
        ),
        ("t2i_training", "DAPO", "'DAPO' is a setting of 'grpo' (docs/algorithms.md): algo.name=grpo"),
        ("ar_training", "ppo", "'ppo' is not an algorithm; the algorithms: flow_grpo, nft, awm, dgpo, grpo."),
    ],
)
def test_another_algorithms_name_points_to_its_config(config, name, fix):
    with pytest.raises(ConfigError) as err:
        load_config([f"algo.name={name}"], config)
    assert err.value.key == "algo.name" and fix in str(err.value)


def test_missing_required_value_is_named(tmp_path):
    custom = tmp_path / "missing.yaml"
    custom.write_text("defaults:\n  - dit_schema\n  - _self_\nrun_name: no-model\n")
    with pytest.raises(ConfigError, match="model.name.*required.*model=tiny"):
        load_config(["--config", str(custom)], "t2i_training")


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("train_dit.py", ["algo.clip_rnge=0.1"], "algo.clip_range"),
        ("train_dit.py", ["sampling.height=65"], "sampling.height"),
        ("train_dit.py", ["--config", "configs/nope.yaml"], "--config"),
        ("train_ar.py", ["algo.epsilon_hgh=0.3"], "algo.epsilon_high"),
        ("train_dit.py", ["model.lora.rank=abc"], "model.lora.rank"),
    ],
)
def test_entry_points_exit_nonzero_before_loading_any_model(script, args, needle):
    start = children_cpu_seconds()
    result = run_cli([PYTHON, script, *args], timeout=60)
    cpu_seconds = children_cpu_seconds() - start
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert "[load]" not in result.stderr  # nothing was loaded
    assert "Traceback" not in result.stderr
    assert cpu_seconds < 10, f"took {cpu_seconds:.1f} CPU s"


@pytest.mark.parametrize(
    ("overrides", "field", "needle"),
    [
        (["trainer.strategy=deepspeed"], "trainer.strategy", "trainer.strategy=fsdp"),
        (["trainer.strategy=fsdp", "trainer.mixed_precision=fp16"], "trainer.mixed_precision", "use bf16"),
    ],
    ids=["deepspeed", "fsdp-fp16"],
)
def test_unsupported_engines_are_refused_with_the_fix(overrides, field, needle):
    with pytest.raises(ConfigError, match=field) as info:
        load_config(overrides, "t2i_training")
    assert needle in str(info.value)


def test_compiled_ar_sampling_under_fsdp_is_refused_with_the_fix():
    overrides = ["trainer.strategy=fsdp", "sampling.compile=true"]
    with pytest.raises(ConfigError, match="sampling.compile") as info:
        load_config(overrides, "ar_training")
    needle = "sampling.compile=false"
    assert needle in str(info.value)


def test_base_model_identity_covers_what_picks_a_fixtures_weights():
    from glm_training.config import ModelConfig

    # Export and model.ar_weights / dit_weights combine runs only when these are equal.
    assert (
        ModelConfig(name="tiny", tiny_seed=0).base_model_id()
        != ModelConfig(name="tiny", tiny_seed=1).base_model_id()
    )
    one, two = (ModelConfig(name="glm_image_shape", shape_num_dit_layers=n) for n in (1, 2))
    assert one.base_model_id() != two.base_model_id()
    assert one.base_model_id() == ModelConfig(name="glm_image_shape").base_model_id()
    # A real checkpoint's weights do not depend on the tiny seed.
    real = ModelConfig(name="zai-org/GLM-Image", tiny_seed=0).base_model_id()
    assert real == ModelConfig(name="zai-org/GLM-Image", tiny_seed=3).base_model_id()


def test_verl_loss_options_are_checked():
    cfg = load_config(
        ["algo.clip_ratio_c=3.0", "algo.log_ratio_clamp=20", "algo.kl_low_var_clamp=true"], "ar_training"
    )
    assert (cfg.algo.clip_ratio_c, cfg.algo.log_ratio_clamp, cfg.algo.kl_low_var_clamp) == (3.0, 20.0, True)
    assert load_config([], "ar_training").algo.clip_ratio_c is None  # off by default: TRL's loss
    with pytest.raises(ConfigError, match="algo.clip_ratio_c"):
        load_config(["algo.clip_ratio_c=0.5"], "ar_training")
    with pytest.raises(ConfigError, match="algo.clip_ratio_c.*GSPO"):
        load_config(["algo.importance_sampling_level=sequence", "algo.clip_ratio_c=3.0"], "ar_training")


def test_compile_blocks_is_the_dit_s():
    with pytest.raises(ConfigError, match="model.compile_blocks.*sampling.compile=true"):
        load_config(["model.compile_blocks=true"], "ar_training")
    assert load_config(["model.compile_blocks=true"], "t2i_training").model.compile_blocks
    with pytest.raises(ConfigError, match="model.compile_blocks.*model.gradient_checkpointing=false"):
        load_config(["model.compile_blocks=true", "model.gradient_checkpointing=true"], "t2i_training")
    joint = load_config(["model.compile_blocks=true"], "joint_training")
    assert joint.half("dit").model.compile_blocks and not joint.half("ar").model.compile_blocks

"""Hydra's own flags in the entry points: --cfg job|all|hydra, --help with every key's doc, hydra.run.dir."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import pytest
import yaml
from conftest import PYTHON, children_cpu_seconds, run_cli

from glm_training.cli import run
from glm_training.config import ConfigError, config_to_yaml, load_config, option
from glm_training.config.help import field_docs
from glm_training.engine.trainer import ARTrainer, DiTTrainer


def keys(node, prefix=""):
    """(dotted key, owning dataclass, field name) of every leaf of a config."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            yield from keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", type(node), f.name


def test_cfg_job_prints_the_resolved_yaml_and_loads_no_model():
    start = children_cpu_seconds()
    result = run_cli(
        [PYTHON, "train_dit.py", "--config", "configs/t2i_training.yaml", "--cfg", "job", "algo.beta=0.04"],
        timeout=60,
    )
    cpu_seconds = children_cpu_seconds() - start
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    expected = load_config(["--config", "configs/t2i_training.yaml", "algo.beta=0.04"])
    assert printed == yaml.safe_load(config_to_yaml(expected))  # exactly the run's config.yaml
    assert printed["algo"]["beta"] == 0.04
    assert "[load]" not in result.stderr and "Traceback" not in result.stderr
    assert cpu_seconds < 15, f"took {cpu_seconds:.1f} CPU s"


def test_cfg_all_and_hydra_print_the_run_dir_and_the_sources(capsys, tmp_path):
    argv = ["--cfg", "all", f"hydra.run.dir={tmp_path}", "model=glm_image"]
    assert run(DiTTrainer, "t2i_training", argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["hydra"]["run"]["dir"] == str(tmp_path)
    assert printed["trainer"]["output_dir"] == str(tmp_path)  # hydra.run.dir is the output folder
    assert printed["hydra"]["job"]["config_name"] == "t2i_training"
    assert (
        printed["model"]["name"] == "zai-org/GLM-Image"
        and "model=glm_image" in printed["hydra"]["overrides"]["task"]
    )

    assert run(ARTrainer, "ar_training", ["--cfg=hydra", "--resolve"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert list(printed) == ["hydra"] and printed["hydra"]["run"]["dir"] == "outputs/ar-<start time>"


def test_help_lists_the_groups_and_every_key_with_its_doc():
    result = run_cli([PYTHON, "train_ar.py", "--help"], timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "model: glm_image | glm_image_shape | tiny" in text
    assert "--cfg job" in text and "hydra.run.dir" in text
    lines = text.splitlines()
    for key, cls, name in keys(load_config(config="ar_training")):
        index = next((i for i, line in enumerate(lines) if line.startswith(f"  {key}: ")), None)
        assert index is not None, f"{key} missing from --help"
        doc = []
        for line in lines[index + 1 :]:
            if not line.startswith(" " * 6):
                break
            doc.append(line.strip())
        assert " ".join(doc) == " ".join(field_docs(cls)[name].split()), key


@pytest.mark.parametrize("config", ["t2i_training", "ar_training"])
def test_every_key_of_both_schemas_has_a_doc(config):
    missing = [key for key, cls, name in keys(load_config(config=config)) if not field_docs(cls).get(name)]
    assert not missing, (
        f"document these fields with option(default, help) in their config dataclass: {missing}"
    )


def test_docs_come_from_the_help_metadata_of_the_fields():
    @dataclass
    class Planted:
        a: int = option(1, "Over two\n   lines, joined.")
        b: str = "# not a doc"
        c: list[int] = option(factory=lambda: [1], help="a list")

    assert field_docs(Planted) == {"a": "Over two lines, joined.", "c": "a list"}
    assert Planted().c == [1] and Planted().c is not Planted().c


def test_hydra_run_dir_sets_the_output_dir_and_other_hydra_keys_are_refused(tmp_path):
    assert load_config([f"hydra.run.dir={tmp_path}"]).trainer.output_dir == str(tmp_path)
    assert load_config(overrides=[f"++hydra.run.dir={tmp_path}"]).trainer.output_dir == str(tmp_path)
    with pytest.raises(ConfigError, match="keep one of the two"):
        load_config(["hydra.run.dir=a", "trainer.output_dir=b"])
    with pytest.raises(ConfigError, match="hydra.job.chdir.*no effect.*hydra.run.dir"):
        load_config(["hydra.job.chdir=true"])


@pytest.mark.parametrize(
    ("argv", "key", "needle"),
    [
        (["--cfg", "jobs"], "--cfg", "Did you mean 'job'"),
        (["--cfg"], "--cfg", "expects a value"),
        (["-m", "algo.beta=0.1,0.2"], "-m", "sweeps are not supported"),
        (["--info"], "--info", "--cfg job"),
        (["--verbose"], "--verbose", "unknown flag"),
    ],
)
def test_unsupported_flags_name_the_fix(argv, key, needle):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    assert err.value.key == key and needle in str(err.value)


def test_printing_flags_are_for_the_entry_points_only():
    with pytest.raises(ConfigError, match="config_to_yaml"):
        load_config(["--cfg", "job"])
    with pytest.raises(ConfigError, match="entry points only"):
        load_config(["--help"])


def test_a_bad_value_with_cfg_still_exits_2(capsys):
    assert run(DiTTrainer, "t2i_training", ["--cfg", "job", "sampling.height=65"]) == 2
    assert "multiple of 32" in capsys.readouterr().err


def test_what_cfg_job_prints_is_a_config_file_of_its_own(capsys, tmp_path):
    assert run(ARTrainer, "ar_training", ["--cfg", "job", "algo.beta=0.02", "model=glm_image"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    original = load_config(config="ar_training", overrides=["algo.beta=0.02", "model=glm_image"])
    assert load_config(["--config", str(printed)]) == original  # typed by its `component`, validated
    assert load_config(["--config", str(printed), "algo.beta=0.5"]).algo.beta == 0.5
    (tmp_path / "untyped.yaml").write_text("run_name: x\n")
    with pytest.raises(ConfigError, match="names no schema"):
        load_config(["--config", str(tmp_path / "untyped.yaml")])

"""The trainer hierarchy: `RewardTrainer` builds a run's parts with one builder each, `DiTTrainer`,
`ARTrainer` and `JointTrainer` subclass it, and `_build_model` alone decides placement."""

from __future__ import annotations

import ast
import runpy
import sys

import pytest
import yaml
from conftest import DIT_SMALL, REPO

import glm_training as gt
from glm_training.build import build_trainer
from glm_training.engine.trainer import RewardTrainer
from glm_training.metrics import read_metrics

PACKAGE = REPO / "glm_training"
EXAMPLE = REPO / "examples" / "custom_reward_trainer.py"


def _classes() -> dict[str, ast.ClassDef]:
    """Every class of the package, by name (the names are unique)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = node
    return found


def _calls(node: ast.AST) -> set[str]:
    return {
        call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
    }


def test_the_public_trainers_are_one_hierarchy():
    assert gt.RewardTrainer is RewardTrainer and gt.Trainer is RewardTrainer
    for cls in (gt.DiTTrainer, gt.ARTrainer, gt.JointTrainer):
        assert cls.__mro__[1] is RewardTrainer, cls
    assert (gt.DiTTrainer.component, gt.ARTrainer.component, gt.JointTrainer.component) == (
        "dit",
        "ar",
        "joint",
    )


def test_build_model_is_the_one_place_that_loads_and_places():
    """`_build_model` is defined once, on `RewardTrainer`, and is the only caller in the package of `Policy`
    (loading and placement) and `make_parallelism` (the strategy); every trainer that has a constructor of
    its own calls its parent's."""
    classes = _classes()
    defines = [
        name
        for name, node in classes.items()
        if "_build_model" in {getattr(f, "name", "") for f in node.body}
    ]
    assert defines == ["RewardTrainer"]
    callers = {
        (path.relative_to(PACKAGE).as_posix(), f.name)
        for path in PACKAGE.rglob("*.py")
        for f in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(f, ast.FunctionDef) and _calls(f) & {"Policy", "make_parallelism"}
    }
    assert callers == {("engine/trainer.py", "_build_model")}
    for name in ("DiTTrainer", "ARTrainer", "JointTrainer"):
        init = [f for f in classes[name].body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
        assert all("__init__" in _calls(f) for f in init), name


@pytest.mark.parametrize(
    ("component", "config", "expected"),
    [
        ("dit", "t2i_training", "DiTTrainer"),
        ("ar", "ar_training", "ARTrainer"),
        ("joint", "joint_training", "JointTrainer"),
    ],
)
def test_the_entry_points_build_their_halfs_trainer(monkeypatch, component, config, expected):
    """`build_trainer` returns the half's subclass (stopped at its first step: nothing loads)."""

    class Built(Exception):
        pass

    def stop(self, cfg):
        raise Built(type(self).__name__)

    monkeypatch.setattr(RewardTrainer, "_check_component", stop)
    with pytest.raises(Built, match=f"^{expected}$"):
        build_trainer(gt.load_config([], config), component)


def test_a_bare_reward_trainer_refuses_a_joint_config(tmp_path):
    with pytest.raises(gt.ConfigError, match="RewardTrainer trains one half; .*use JointTrainer"):
        gt.RewardTrainer(gt.load_config([f"trainer.output_dir={tmp_path}"], "joint_training"))
    assert not any(tmp_path.iterdir())


def test_the_documented_subclass_overrides_one_builder_and_trains(tmp_path, monkeypatch):
    """examples/custom_reward_trainer.py, shown in docs/architecture.md: its `_build_inputs` replaces the
    config's reward with its own, and the run trains on it."""
    source = EXAMPLE.read_text(encoding="utf-8")
    shown = source[source.index("def brightness") : source.index("\n\nif __name__")]
    assert shown in (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    out = tmp_path / "bright"
    argv = [str(EXAMPLE), *DIT_SMALL, "trainer.num_steps=1", f"trainer.output_dir={out}"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    (row,) = read_metrics(out / "metrics.jsonl")
    assert "reward/brightness" in row and "reward/jpeg_compressibility" not in row
    assert 0.0 <= row["reward/brightness"] <= 1.0 and row["reward_mean"] == pytest.approx(
        row["reward/brightness"]
    )
    recorded = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))["reward"]
    assert recorded["names"] == ["brightness"] and recorded["weights"] == [1.0]

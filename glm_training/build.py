"""The trainer of a run config: the one place that ties the config layer (which validates and describes,
and builds nothing) to the trainers above it. The entry points (`cli.run`) call it."""

from __future__ import annotations

from typing import Any

from glm_training.config.options import ConfigError

SCRIPTS = {"dit": "train_dit.py", "ar": "train_ar.py", "joint": "train_joint.py"}


def build_trainer(cfg: Any, component: str) -> Any:
    """The trainer of `cfg`, for the entry point that trains `component` (`train_dit.py`: dit, `train_ar.py`:
    ar, `train_joint.py`: joint): `DiTTrainer`, `ARTrainer` or `JointTrainer`; the engine builds the
    algorithm `algo.name` names."""
    if cfg.component != component:
        what = "both halves" if cfg.component == "joint" else f"the {cfg.component} half"
        raise ConfigError(
            "component",
            f"this config trains {what}; run it with {SCRIPTS[cfg.component]}, or give "
            f"{SCRIPTS[component]} a {component} config.",
        )
    if component == "joint":
        from glm_training.joint.trainer import JointTrainer

        return JointTrainer(cfg)
    from glm_training.engine.trainer import ARTrainer, DiTTrainer

    return {"dit": DiTTrainer, "ar": ARTrainer}[component](cfg)

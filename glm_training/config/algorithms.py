"""The algorithm table: each RL algorithm the project trains, and everything that is chosen by its name.

One `AlgorithmSpec` per `algo.name` (`config/spec.py`), declared in its folder
(`algorithms/<name>/__init__.py`) and listed once in `BUILTIN`; a user registers their own with
`register_algorithm`. Every consumer reads the table: Hydra's ConfigStore (the schema a YAML's defaults list
names), the loading of a saved run's `config.yaml`, the engine (which algorithm class it builds), the memory
plan (the extra weight copies it keeps) and `--help`. Adding a decoder algorithm means its folder in
`algorithms/`, one line in `BUILTIN`, and its configs, tests and docs (`docs/architecture.md`).

Torch-free: the folders' `__init__` import only their configs, and the algorithm classes are named as
"module:Class", imported when training starts, so `--cfg` and `--help` answer without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from glm_training.config.model import ModelConfig
from glm_training.config.options import ConfigError, _check_choice
from glm_training.config.spec import ALGORITHMS, AlgorithmSpec

# The shipped algorithms: the package of each, whose `SPEC` is its row of the table.
BUILTIN = (
    "glm_training.algorithms.flow_grpo",
    "glm_training.algorithms.nft",
    "glm_training.algorithms.awm",
    "glm_training.algorithms.dgpo",
    "glm_training.algorithms.grpo",
)

# The algorithm a saved config without `algo.name` was trained with (configs from before the name existed).
DEFAULT_ALGORITHM = {"dit": "flow_grpo", "ar": "grpo"}
# The schema of `train_joint.py`'s configs (`config/joint.py`: both halves, each with one of the algorithms).
JOINT_SCHEMA = "joint_schema"
JOINT_CONFIG = "joint_training"  # its tiny quick-start in configs/


def register_algorithm(algorithm: AlgorithmSpec) -> AlgorithmSpec:
    """Add `algorithm` to the table (Hydra gets its run config when a config is next composed)."""
    if algorithm.component not in DEFAULT_ALGORITHM:
        raise ValueError(
            f"component must be one of {sorted(DEFAULT_ALGORITHM)}, got '{algorithm.component}'."
        )
    known = ALGORITHMS.get(algorithm.name)
    if known is not None and known != algorithm:
        raise ValueError(f"an algorithm named '{algorithm.name}' is already registered: {known}.")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


for _package in BUILTIN:
    register_algorithm(importlib.import_module(_package).SPEC)


def algorithm_named(name: str, component: str | None = None, key: str = "algo.name") -> AlgorithmSpec:
    """The entry for `name` (of `component`'s algorithms when given); a `ConfigError` naming the choices."""
    choices = tuple(n for n, a in ALGORITHMS.items() if component is None or a.component == component)
    _check_choice(name, choices, key)
    return ALGORITHMS[name]


def algorithm_of(cfg: Any) -> AlgorithmSpec:
    """The entry of a run config (or a saved one: no `algo.name` means its component's first algorithm)."""
    component = _get(cfg, "component", "dit")
    if component not in DEFAULT_ALGORITHM:
        raise ConfigError("component", f"'{component}' is neither 'dit' nor 'ar'.")
    name = _get(_get(cfg, "algo", None), "name", None) or DEFAULT_ALGORITHM[component]
    return algorithm_named(name, component)


def _get(node: Any, key: str, default: Any) -> Any:
    if node is None:
        return default
    if hasattr(node, "get") and not isinstance(node, type):
        return node.get(key, default)
    return getattr(node, key, default)


def register_configs() -> None:
    """Register every algorithm's run config in Hydra's ConfigStore; YAML files name them in defaults."""
    from hydra.core.config_store import ConfigStore

    from glm_training.config.joint import JointTrainConfig

    cs = ConfigStore.instance()
    for algorithm in ALGORITHMS.values():
        cs.store(name=algorithm.schema, node=algorithm.run_config)
    cs.store(name=JOINT_SCHEMA, node=JointTrainConfig)  # train_joint.py: both halves, one rollout
    cs.store(group="model", name="model_schema", node=ModelConfig)


__all__ = [
    "ALGORITHMS",
    "AlgorithmSpec",
    "BUILTIN",
    "algorithm_named",
    "algorithm_of",
    "register_algorithm",
    "register_configs",
]

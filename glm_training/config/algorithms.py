"""The algorithm table: each RL algorithm the project trains, and everything that is chosen by its name.

One entry per `algo.name`, read by every consumer: Hydra's ConfigStore (the schema a YAML's defaults list
names), the loading of a saved run's `config.yaml`, the entry points (which trainer class trains it), the
memory plan (the extra weight copies it keeps) and `--help`. Adding a decoder algorithm means: its loss in
`algorithms/`, a trainer class (a `DiffusionTrainer` subclass), its run config in `config/schema.py` and one
`register_algorithm(Algorithm(...))` here or in the user's own code (`docs/architecture.md`).

Torch-free: the trainer is named as "module:Class" and imported only when training starts, so `--cfg` and
`--help` answer without loading torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any

from glm_training.config.schema import (
    ARTrainConfig,
    AWMTrainConfig,
    ConfigError,
    DiffusionSamplingConfig,
    DiTSamplingConfig,
    DiTTrainConfig,
    ModelConfig,
    NFTTrainConfig,
    _check_choice,
)

# Flow-GRPO's SDE sampling keys (DiTSamplingConfig) beyond those every decoder algorithm samples with.
FLOW_GRPO_SAMPLING_KEYS = tuple(
    f.name
    for f in fields(DiTSamplingConfig)
    if f.name not in {g.name for g in fields(DiffusionSamplingConfig)}
)


@dataclass(frozen=True)
class Algorithm:
    """One trainable algorithm: its name, the half it trains, its run config and its trainer."""

    name: str  # `algo.name` in its configs
    component: str  # the half of GLM-Image it trains: "dit" | "ar"
    run_config: type  # the run config dataclass (its `algo` section has `name` = this name)
    schema: str  # the run config's name in Hydra's ConfigStore, as YAML defaults lists name it
    # Its trainer class, or "module:Class" (imported when training starts: the shipped ones are named so).
    trainer: str | type
    config: str  # the shipped config in `configs/` that trains it on the tiny model
    # The extra copies of the trained weights it keeps, by name (the memory plan adds a term for each).
    policy_copies: tuple[str, ...] = ()
    # Keys that saved run configs of it may hold but it never read (dropped when a saved config loads).
    retired_keys: tuple[str, ...] = ()

    def trainer_class(self) -> type:
        if isinstance(self.trainer, type):
            return self.trainer
        module, _, name = self.trainer.partition(":")
        return getattr(importlib.import_module(module), name)


ALGORITHMS: dict[str, Algorithm] = {}
# The algorithm a saved config without `algo.name` was trained with (configs from before the name existed).
DEFAULT_ALGORITHM = {"dit": "flow_grpo", "ar": "grpo"}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
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


register_algorithm(
    Algorithm(
        name="flow_grpo",
        component="dit",
        run_config=DiTTrainConfig,
        schema="dit_schema",
        trainer="glm_training.trainers.dit_trainer:DiTTrainer",
        config="t2i_training",
    )
)
register_algorithm(
    Algorithm(
        name="nft",
        component="dit",
        run_config=NFTTrainConfig,
        schema="nft_schema",
        trainer="glm_training.trainers.nft_trainer:NFTTrainer",
        config="nft_training",
        policy_copies=("NFT old model",),  # the old (sampling) model
        # Before DiffusionNFT had a sampling section of its own it carried Flow-GRPO's SDE keys, unread.
        retired_keys=tuple(f"sampling.{key}" for key in FLOW_GRPO_SAMPLING_KEYS),
    )
)
register_algorithm(
    Algorithm(
        name="awm",
        component="dit",
        run_config=AWMTrainConfig,
        schema="awm_schema",
        trainer="glm_training.trainers.awm_trainer:AWMTrainer",
        config="awm_training",
        policy_copies=("AWM EMA anchor",),  # the KL anchor (algo.ema_beta)
    )
)
register_algorithm(
    Algorithm(
        name="grpo",
        component="ar",
        run_config=ARTrainConfig,
        schema="ar_schema",
        trainer="glm_training.trainers.ar_trainer:ARTrainer",
        config="ar_training",
    )
)


def algorithm_named(name: str, component: str | None = None, key: str = "algo.name") -> Algorithm:
    """The entry for `name` (of `component`'s algorithms when given); a `ConfigError` naming the choices."""
    choices = tuple(n for n, a in ALGORITHMS.items() if component is None or a.component == component)
    _check_choice(name, choices, key)
    return ALGORITHMS[name]


def algorithm_of(cfg: Any) -> Algorithm:
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


def build_trainer(cfg: Any, component: str) -> Any:
    """The trainer of `cfg`'s algorithm, for the entry point that trains `component` (`train_dit.py`: dit)."""
    if cfg.component != component:
        script = {"dit": "train_dit.py", "ar": "train_ar.py"}
        raise ConfigError(
            "component",
            f"this config trains the {cfg.component} half; run it with {script[cfg.component]}, or give "
            f"{script[component]} a {component} config.",
        )
    return algorithm_of(cfg).trainer_class()(cfg)


def register_configs() -> None:
    """Register every algorithm's run config in Hydra's ConfigStore; YAML files name them in defaults."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for algorithm in ALGORITHMS.values():
        cs.store(name=algorithm.schema, node=algorithm.run_config)
    cs.store(group="model", name="model_schema", node=ModelConfig)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "algorithm_named",
    "algorithm_of",
    "build_trainer",
    "register_algorithm",
    "register_configs",
]

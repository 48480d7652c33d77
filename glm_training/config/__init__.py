"""Configuration: the building blocks (`options.py`), the shared sections (`model.py`, `schema.py`), the run
config and the `algo` fields every algorithm has (`run.py`), the algorithm table (`algorithms.py`, each row in
its algorithm's folder with its own sections), loading a command line or a saved run (`loading.py`) and what
`--help` / `--cfg` print (`help.py`).

The names below are what the rest of the project and users import from `glm_training.config`. They are
loaded on first use (module `__getattr__`, as the package's own `__init__`): each algorithm's config section
imports this package's building blocks, and the table imports the algorithms' sections, so importing them all
here would be a circle whichever module is imported first.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ALGORITHMS": "glm_training.config.algorithms",
    "ARSamplingConfig": "glm_training.algorithms.grpo.config",
    "ARTrainConfig": "glm_training.algorithms.grpo.config",
    "AWMConfig": "glm_training.algorithms.awm.config",
    "AWMTrainConfig": "glm_training.algorithms.awm.config",
    "AlgoConfig": "glm_training.config.run",
    "AlgorithmSpec": "glm_training.config.algorithms",
    "BUILTIN": "glm_training.config.algorithms",
    "BUNDLED_EVAL_PROMPTS": "glm_training.config.options",
    "BUNDLED_PROMPTS": "glm_training.config.options",
    "CFG_CHOICES": "glm_training.config.loading",
    "CONFIG_DIR": "glm_training.config.options",
    "CommandLine": "glm_training.config.loading",
    "ConfigError": "glm_training.config.options",
    "DAPOConfig": "glm_training.algorithms.grpo.config",
    "DataConfig": "glm_training.config.schema",
    "DiTSamplingConfig": "glm_training.algorithms.flow_grpo.config",
    "DiTTrainConfig": "glm_training.algorithms.flow_grpo.config",
    "DiffusionSamplingConfig": "glm_training.algorithms.decoder.config",
    "EvalConfig": "glm_training.config.schema",
    "FlowGRPOConfig": "glm_training.algorithms.flow_grpo.config",
    "HYDRA_KEYS": "glm_training.config.loading",
    "LoggingConfig": "glm_training.config.schema",
    "LoraConfig": "glm_training.config.model",
    "MISSING": "omegaconf",
    "ModelConfig": "glm_training.config.model",
    "NFTConfig": "glm_training.algorithms.nft.config",
    "NFTTrainConfig": "glm_training.algorithms.nft.config",
    "OptimConfig": "glm_training.config.schema",
    "RewardConfig": "glm_training.config.schema",
    "RunConfig": "glm_training.config.run",
    "TrainerConfig": "glm_training.config.schema",
    "algorithm_named": "glm_training.config.algorithms",
    "algorithm_of": "glm_training.config.algorithms",
    "available_configs": "glm_training.config.loading",
    "compose_config": "glm_training.config.loading",
    "config_to_yaml": "glm_training.config.loading",
    "load_config": "glm_training.config.loading",
    "load_run_config": "glm_training.config.loading",
    "option": "glm_training.config.options",
    "parse_command_line": "glm_training.config.loading",
    "register_algorithm": "glm_training.config.algorithms",
    "register_configs": "glm_training.config.algorithms",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm_training.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

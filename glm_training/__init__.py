"""glm-training: reward fine-tuning of GLM-Image (Flow-GRPO on the DiT decoder, GRPO/DAPO on the AR model).

The Python API, as TRL users know it:

    import glm_training as gt

    cfg = gt.load_config(["trainer.num_steps=100"])  # configs/t2i_training.yaml + overrides
    trainer = gt.DiTTrainer(cfg, reward_funcs=[my_reward])  # fn(images, prompts, metadata) -> N floats
    output_dir = trainer.train()

The names below are loaded on first use (module `__getattr__`, as diffusers and transformers do), so
`import glm_training` costs nothing until a trainer, a config or a reward is touched. They are strings here,
not imports: every project module imports this package first, so importing a trainer here would be a circle.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> (module, attribute).
_EXPORTS: dict[str, tuple[str, str]] = {
    # Trainers: `DiTTrainer(cfg, reward_funcs=None, reward_weights=None).train()` -> output folder. All are
    # `RewardTrainer`s (`Trainer` is its earlier name).
    "RewardTrainer": ("glm_training.engine.trainer", "RewardTrainer"),
    "DiTTrainer": ("glm_training.engine.trainer", "DiTTrainer"),
    "ARTrainer": ("glm_training.engine.trainer", "ARTrainer"),
    "JointTrainer": ("glm_training.joint.trainer", "JointTrainer"),
    "Trainer": ("glm_training.engine.trainer", "RewardTrainer"),
    # Algorithms: the base class a new one subclasses, and the table it is registered in.
    "Algorithm": ("glm_training.algorithms.base", "Algorithm"),
    "AlgorithmSpec": ("glm_training.config.spec", "AlgorithmSpec"),
    "register_algorithm": ("glm_training.config.algorithms", "register_algorithm"),
    # Configs: the dataclasses (constructible directly) and the YAML + overrides loader.
    "DiTTrainConfig": ("glm_training.config", "DiTTrainConfig"),
    "ARTrainConfig": ("glm_training.config", "ARTrainConfig"),
    "JointTrainConfig": ("glm_training.config.joint", "JointTrainConfig"),
    "load_config": ("glm_training.config", "load_config"),
    "config_to_yaml": ("glm_training.config", "config_to_yaml"),
    "ConfigError": ("glm_training.config", "ConfigError"),
    "UserError": ("glm_training.errors", "UserError"),
    # Rewards: the interface, the registry, several rewards as one.
    "Reward": ("glm_training.rewards", "Reward"),
    "register_reward": ("glm_training.rewards", "register_reward"),
    "available_rewards": ("glm_training.rewards", "available_rewards"),
    "build_reward": ("glm_training.rewards", "build_reward"),
    "RewardSet": ("glm_training.rewards", "RewardSet"),
    # Prompts.
    "Prompt": ("glm_training.data", "Prompt"),
    "load_prompts": ("glm_training.data", "load_prompts"),
    "ocr_prompt_sets": ("glm_training.prompts", "ocr_prompt_sets"),
    # After training: export a diffusers folder, evaluate weights on held-out prompts.
    "export_pipeline": ("glm_training.export", "export"),
    "load_pipeline_from_checkpoints": ("glm_training.export", "load_pipeline_from_checkpoints"),
    "evaluate_prompts": ("glm_training.evaluation", "evaluate_prompts"),
    "eval_sampling": ("glm_training.evaluation", "eval_sampling"),
    "load_eval_prompts": ("glm_training.evaluation", "load_eval_prompts"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'glm_training' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module_name), attribute)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

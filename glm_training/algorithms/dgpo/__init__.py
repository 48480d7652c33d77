"""DGPO (Luo et al., "Reinforcing Diffusion Models by Direct Group Preference Optimization"; the authors'
`Luo-Yihong/DGPO`) on the DiT decoder: `config.py`, `losses.py` (its math), `algorithm.py` (`DGPO`); group
preference optimization on ODE rollouts, trained on the forward process like DiffusionNFT and AWM."""

from glm_training.algorithms.dgpo.config import DGPOTrainConfig
from glm_training.config.spec import AlgorithmSpec

SPEC = AlgorithmSpec(
    name="dgpo",
    component="dit",
    run_config=DGPOTrainConfig,
    schema="dgpo_schema",
    algorithm="glm_training.algorithms.dgpo.algorithm:DGPO",
    config="dgpo_training",
    policy_copies=("DGPO EMA reference",),  # the clip's old model, and the sampler after switch_ema_ref
)

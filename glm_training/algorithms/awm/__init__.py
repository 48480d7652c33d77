"""Advantage Weighted Matching (arXiv 2509.25050) on the DiT decoder: `config.py`, `losses.py` (its math),
`algorithm.py` (`AWM`); it samples and trains in the decoder's forward-process frame
(`algorithms/decoder/`)."""

from glm_training.algorithms.awm.config import AWMTrainConfig
from glm_training.config.spec import AlgorithmSpec

SPEC = AlgorithmSpec(
    name="awm",
    component="dit",
    run_config=AWMTrainConfig,
    schema="awm_schema",
    algorithm="glm_training.algorithms.awm.algorithm:AWM",
    config="awm_training",
    policy_copies=("AWM EMA anchor",),  # the KL anchor (algo.ema_beta)
)

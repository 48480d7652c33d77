"""GRPO on the AR model, with DAPO's refinements and GSPO's sequence-level ratios as its settings:
`config.py`, `gspo.py` (GSPO's math; the clipped objective is `algorithms/losses.py`), `log_probs.py`
(teacher-forced log-probs), `dynamic_sampling.py` (DAPO's), `algorithm.py` (`GRPO`)."""

from glm_training.algorithms.grpo.config import ARTrainConfig
from glm_training.config.spec import AlgorithmSpec

SPEC = AlgorithmSpec(
    name="grpo",
    component="ar",
    run_config=ARTrainConfig,
    schema="ar_schema",
    algorithm="glm_training.algorithms.grpo.algorithm:GRPO",
    config="ar_training",
    variants=("dapo", "gspo"),
)

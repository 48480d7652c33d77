"""Flow-GRPO (arXiv 2505.05470) on the DiT decoder, with GRPO-Guard, CPS, Flow-GRPO-Fast and MixGRPO as its
options: `config.py` (its sections), `sde.py` and `losses.py` (its math), `rollout.py` (SDE trajectories with
log-probs), `algorithm.py` (`FlowGRPO`)."""

from glm_training.algorithms.flow_grpo.config import DiTTrainConfig
from glm_training.config.spec import AlgorithmSpec

SPEC = AlgorithmSpec(
    name="flow_grpo",
    component="dit",
    run_config=DiTTrainConfig,
    schema="dit_schema",
    algorithm="glm_training.algorithms.flow_grpo.algorithm:FlowGRPO",
    config="t2i_training",
)

"""DiffusionNFT (arXiv 2509.16117) on the DiT decoder: `config.py`, `losses.py` (its math), `algorithm.py`
(`NFT`); it samples and trains in the decoder's forward-process frame (`algorithms/decoder/`)."""

from glm_training.algorithms.nft.config import NFTTrainConfig
from glm_training.config.spec import AlgorithmSpec

# Flow-GRPO's SDE sampling keys, which DiffusionNFT's configs carried, unread, before it had a sampling
# section of its own: dropped when such a saved config loads.
_FLOW_GRPO_SAMPLING_KEYS = (
    "noise_level",
    "sde_type",
    "cps_log_prob",
    "sde_window_start",
    "sde_window_end",
    "sde_window_size",
    "sde_window_range",
    "sde_window_schedule",
    "sde_window_stride",
    "sde_window_every",
)

SPEC = AlgorithmSpec(
    name="nft",
    component="dit",
    run_config=NFTTrainConfig,
    schema="nft_schema",
    algorithm="glm_training.algorithms.nft.algorithm:NFT",
    config="nft_training",
    policy_copies=("NFT old model",),  # the old (sampling) model
    retired_keys=tuple(f"sampling.{key}" for key in _FLOW_GRPO_SAMPLING_KEYS),
)

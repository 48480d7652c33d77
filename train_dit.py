"""Reward training of the GLM-Image DiT decoder: Flow-GRPO, DiffusionNFT, AWM or DGPO (the config's
`algo.name`).

python train_dit.py                                          # Flow-GRPO, tiny offline model, CPU, minutes
python train_dit.py --config configs/nft_training.yaml      # DiffusionNFT, tiny model, about a minute
python train_dit.py --config configs/awm_training.yaml      # AWM, tiny model, about a minute
python train_dit.py --config configs/dgpo_training.yaml     # DGPO, tiny model, about a minute
torchrun --nproc_per_node=8 train_dit.py --config-name recipes/flow_grpo_fast_ocr  # GLM-Image, see recipes

`algo.name` picks the algorithm from the algorithm table (`glm_training/config/algorithms.py`); it is imported
when training starts, so that --cfg and --help answer without loading torch.
"""

import sys

from glm_training.cli import run

if __name__ == "__main__":
    sys.exit(run("dit", "t2i_training"))

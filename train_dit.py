"""Reward training of the GLM-Image DiT decoder: Flow-GRPO, or DiffusionNFT with configs/nft_training.yaml.

python train_dit.py                                          # tiny offline model, CPU, a few minutes
python train_dit.py --config configs/nft_training.yaml      # DiffusionNFT, tiny model, about a minute
python train_dit.py --config configs/t2i_training.yaml model=glm_image reward.names=[ocr] ...
torchrun --nproc_per_node=8 train_dit.py --config configs/t2i_training.yaml model=glm_image ...

`algo.name` picks the trainer from the algorithm table (`glm_training/config/algorithms.py`); it is imported
when training starts, so that --cfg and --help answer without loading torch.
"""

import sys

from glm_training.cli import run

if __name__ == "__main__":
    sys.exit(run("dit", "t2i_training"))

"""Reward training of the GLM-Image DiT decoder: Flow-GRPO, or DiffusionNFT with configs/nft_training.yaml.

python train_dit.py                                          # tiny offline model, CPU, a few minutes
python train_dit.py --config configs/nft_training.yaml      # DiffusionNFT, tiny model, about a minute
python train_dit.py --config configs/t2i_training.yaml model=glm_image reward.names=[ocr] ...
torchrun --nproc_per_node=8 train_dit.py --config configs/t2i_training.yaml model=glm_image ...
"""

import sys

from glm_training.cli import run


def dit_trainer(cfg):
    """`algo.name` -> the DiT trainer: the one place the algorithm picks its class.

    Imported here, when training starts, so that --cfg and --help answer without loading torch.
    """
    from glm_training.trainers.dit_trainer import DiTTrainer
    from glm_training.trainers.nft_trainer import NFTTrainer

    return {"flow_grpo": DiTTrainer, "nft": NFTTrainer}[cfg.algo.name](cfg)


if __name__ == "__main__":
    sys.exit(run(dit_trainer, "t2i_training"))

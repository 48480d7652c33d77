"""GRPO/DAPO reward training of the GLM-Image autoregressive model.

python train_ar.py                                           # tiny offline model, CPU, a few minutes
python train_ar.py --config configs/ar_training.yaml model=glm_image reward.names=[pickscore] ...
torchrun --nproc_per_node=8 train_ar.py --config configs/ar_training.yaml model=glm_image ...
"""

import sys

from glm_training.cli import run
from glm_training.trainers.ar_trainer import ARTrainer

if __name__ == "__main__":
    sys.exit(run(ARTrainer, "ar_training"))

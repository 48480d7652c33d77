"""GRPO/DAPO reward training of the GLM-Image autoregressive model.

python train_ar.py                                           # tiny offline model, CPU, a few minutes
torchrun --nproc_per_node=8 train_ar.py --config-name recipes/dapo_aesthetic_alignment  # docs/recipes.md

The algorithm comes from the algorithm table (`glm_training/config/algorithms.py`) when training starts:
--cfg and --help answer without loading torch.
"""

import sys

from glm_training.cli import run

if __name__ == "__main__":
    sys.exit(run("ar", "ar_training"))

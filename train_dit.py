"""Flow-GRPO reward training of the GLM-Image DiT decoder.

python train_dit.py                                          # tiny offline model, CPU, a few minutes
python train_dit.py --config configs/t2i_training.yaml model=glm_image reward.names=[ocr] ...
torchrun --nproc_per_node=8 train_dit.py --config configs/t2i_training.yaml model=glm_image ...
"""

import sys

from glm_training.cli import run

if __name__ == "__main__":
    # The trainer is imported when training starts: --cfg and --help answer without loading torch.
    sys.exit(run("glm_training.trainers.dit_trainer:DiTTrainer", "t2i_training"))

"""Both halves of GLM-Image from one rollout: the AR model (GRPO/DAPO/GSPO, `ar_reward`) and the DiT decoder
(Flow-GRPO, `dit_reward`), each updated every step from the same images (docs/joint.md).

python train_joint.py                                                  # tiny offline model, CPU, minutes
torchrun --nproc_per_node=8 train_joint.py --config-name recipes/joint_glm_image   # GLM-Image, see recipes
"""

import sys

from glm_training.cli import run

if __name__ == "__main__":
    sys.exit(run("joint", "joint_training"))

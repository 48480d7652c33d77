"""A trainer with one builder overridden: the DiT trained for bright images, whatever `reward.names` says.

    .venv/bin/python examples/custom_reward_trainer.py trainer.num_steps=10 trainer.output_dir=outputs/bright

Every part of a run is made by one builder of `gt.RewardTrainer` (docs/architecture.md); here the inputs'.
"""

import sys

import numpy as np

import glm_training as gt


def brightness(images, prompts, metadata):
    return [float(np.asarray(image, dtype=np.float32).mean()) / 255.0 for image in images]


class BrightnessTrainer(gt.DiTTrainer):
    def _build_inputs(self, cfg, reward_funcs, reward_weights):
        return super()._build_inputs(cfg, [brightness], [1.0])


if __name__ == "__main__":
    print(BrightnessTrainer(gt.load_config(sys.argv[1:])).train())

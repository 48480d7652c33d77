"""Both halves of GLM-Image trained from one rollout (`python train_joint.py`): the config is
`config/joint.py`, the step `collect.py`, the run `trainer.py` (docs/joint.md)."""

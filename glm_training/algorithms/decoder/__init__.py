"""What the decoder's algorithms share: the rollout frame (`rollout.py`: prior tokens, micro-batches, decode,
score), the common sampling section (`config.py`), the pipeline's ODE rollout (`ode.py`), and the
forward-process frame of DiffusionNFT and AWM (`forward.py`, `forward_math.py`, `old_policy.py`)."""

"""What the decoder's algorithms share: the rollout frame (`rollout.py`: prior tokens, micro-batches, decode,
score), the common sampling section (`config.py`), the samplers (`ode.py`: the pipeline's ODE rollout;
`sde.py`: the SDE and CPS steps with their log-probs; `trajectory.py`: the rollout that records SDE steps and
their recomputation), and the forward-process frame of DiffusionNFT and AWM (`forward.py`, `forward_math.py`,
`old_policy.py`)."""

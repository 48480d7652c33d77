"""DGPO (Luo et al., "Reinforcing Diffusion Models by Direct Group Preference Optimization"; the authors'
`Luo-Yihong/DGPO`): group-level preference optimization on ODE rollouts. Its math is `losses.py`; its config,
algorithm and table row are to come (issue 36), so it is not registered yet."""

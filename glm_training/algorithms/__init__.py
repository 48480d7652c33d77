"""One folder per algorithm (`flow_grpo/`, `nft/`, `awm/`, `grpo/`), each with its config section, its math
as pure functions, its rollout if it has one and its `Algorithm` class (`base.py`), and its `SPEC` row of the
algorithm table (`config/algorithms.py`); `decoder/` holds what the decoder's algorithms share, `losses.py`
the clipped policy objective and the KL estimators the DiT and the AR model share."""

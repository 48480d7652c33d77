"""The AR rollout's samplers: the policy module itself, or a sampler apart from the learner's forward.

`sampling.sampler` (`SAMPLERS`):

* "policy": the tokens are drawn by the module that trains, LoRA layers computing their adapters as they
  do in the learner's forward (`sample_image_tokens` on the pipeline).
* "folded": a sampler apart from the learner (`FoldedSampler`): every LoRA adapter folded into a sampling copy
  of its layer (`models/folded_lora.py`), refreshed before each rollout, so that the decoding step runs the
  plain model, the one the bare decoding loop times, and compiles into one graph (CUDA graphs on CUDA); its
  per-token steps attend without repeating the key/value heads (`ar_attention.PACKED_GQA`); the KV cache
  and the compiled step are kept from one rollout to the next (`DecodeState`), and the prompts are
  left-padded to a multiple of `PROMPT_MULTIPLE` tokens so that a run's rollouts share a few shapes.

Either way the learner teacher-forces the old log-probs under the weights that sampled (the first ratio is
exactly 1), and the gap between the sampler's log-probs and the learner's is logged at every step
(`sampling_logp_mean_diff`, `sampling_logp_max_diff`); verl's truncated importance sampling can weight the
loss by it (`algo.rollout_is_threshold`, `algorithms/grpo/rollout_is.py`).
"""

from __future__ import annotations

from torch import nn

from glm_training.models.folded_lora import FoldedLoRA
from glm_training.pipeline.ar import ARSamples, sample_image_tokens
from glm_training.pipeline.ar_logits import SamplingParams
from glm_training.pipeline.ar_step import DecodeState

SAMPLERS = ("policy", "folded")

# The folded sampler's prompts are left-padded to a multiple of this many tokens: one compiled graph per
# bucket of prompt lengths instead of one per length.
PROMPT_MULTIPLE = 64


class FoldedSampler:
    """Samples image tokens with `module`'s LoRA adapters folded into sampling copies of their layers."""

    def __init__(self, module: nn.Module, compile: bool) -> None:
        self.folded = FoldedLoRA(module)
        self.state = DecodeState()
        self.compile = compile

    def sample(
        self, pipeline, prompts: list[str], height: int, width: int, params: SamplingParams, seed: int
    ) -> ARSamples:
        """`sample_image_tokens` by the decoding loop, with the adapters' current weights folded in."""
        self.folded.refresh()
        with self.folded.swapped():
            return sample_image_tokens(
                pipeline,
                prompts,
                height,
                width,
                params,
                seed,
                decoding="loop",
                compile=self.compile,
                state=self.state,
                pad_to_multiple_of=PROMPT_MULTIPLE,
                packed_attention=True,
            )

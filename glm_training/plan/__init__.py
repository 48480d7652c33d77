"""Memory plan: what one rank will hold, computed from the configs before any weight is loaded.

    python -m glm_training.plan --config recipes/flow_grpo_fast_ocr [--world-size 8] [--strategy fsdp] \
        [--gpu-memory-gb 80]

Every run logs the same plan at start-up (`log_memory_plan`, before the `Policy` loads the model); on GPUs a
run predicted not to fit stops there, naming the largest terms and the fixes.

The terms, per rank, by module:

* `components.py`: the components on the meta device, from their configs (no weights are read or
  allocated), and their parameter counts;
* `state.py`: weights of each component, by dtype and placement; trainable parameters (LoRA adapters in
  float32, or the whole trained submodules), their gradients and the AdamW state (two tensors of the
  parameter's dtype), an EMA copy, the algorithm's policy copies and, for full fine-tuning with KL, the
  frozen reference copy;
* `sharding.py`: under FSDP (`trainer.strategy=fsdp`) the trainable component's parameters, gradients and
  optimizer state are divided by the shard count, and one shard unit (one DiT block / one GLM decoder
  layer) is gathered at a time (two with prefetching), which the plan adds back. Frozen components are
  replicated on every rank;
* `workload.py`: what differs between the halves: one micro-batch's tokens, batch and width, and the
  trajectory buffers (DiT latents of every trained step, AR token ids);
* `transients.py`: activations saved for the backward pass of one micro-batch, with and without gradient
  checkpointing (`num_layers x tokens x width x coefficient`, the coefficients measured on the real-width
  fixture), plus the AR log-softmax; the rollout's transient peak (the VAE decode of one micro-batch, or
  the sampling gather) when it exceeds the update's;
* `device.py`: `build_plan`, the sum of the above, the reward models (each reward's `approx_params`) and a
  fixed overhead;
* `loading.py`: the host memory while a run loads and shards its model (`loading_host_plan`);
* `report.py`: the terms and the plans' tables; `startup.py`: the plan at a run's start; `cli.py`: the
  command.
"""

from glm_training.plan.cli import main
from glm_training.plan.components import DTYPE_BYTES, lora_params, meta_components
from glm_training.plan.device import OVERHEAD_BYTES, build_plan
from glm_training.plan.loading import LOADING_OVERHEAD_BYTES, loading_host_plan
from glm_training.plan.report import GIB, LoadingPlan, MemoryPlan, MemoryPlanError, Term
from glm_training.plan.startup import check_fits, log_memory_plan
from glm_training.plan.transients import VAE_DECODE_BYTES_PER_PIXEL_CHANNEL, saved_tensor_bytes
from glm_training.plan.workload import AR_LOGIT_COPIES, sequence_tokens

__all__ = [
    "AR_LOGIT_COPIES",
    "DTYPE_BYTES",
    "GIB",
    "LOADING_OVERHEAD_BYTES",
    "OVERHEAD_BYTES",
    "VAE_DECODE_BYTES_PER_PIXEL_CHANNEL",
    "LoadingPlan",
    "MemoryPlan",
    "MemoryPlanError",
    "Term",
    "build_plan",
    "check_fits",
    "loading_host_plan",
    "log_memory_plan",
    "lora_params",
    "main",
    "meta_components",
    "saved_tensor_bytes",
    "sequence_tokens",
]

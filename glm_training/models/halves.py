"""One description of each half of GLM-Image: what every module that treats the halves differently reads.

GLM-Image is trained one half at a time. `component="dit"` trains the diffusion decoder, the pipeline's
`transformer`; `component="ar"` trains the autoregressive model, its `vision_language_encoder`. Everything
that depends on which half trains is a field of its `ModelHalf`, so a model half (or another model with
the same shape) is described once:

- the pipeline attribute and the config key that gives a frozen half trained weights (`wrapper.py`,
  `frozen_weights.py`, `export.py`);
- the submodules the training forward uses, and its repeated layers (the trainers, the memory plan);
- the FSDP units and the units text-to-image never runs (`distributed/sharding.py`, the memory plan);
- the activation coefficients the memory plan multiplies by layers x tokens x width;
- the sampling keys that give the decoder's steps and guidance (evaluation).

The module accessors are functions of the loaded (or meta) module, so they hold for the real model, the
real-width fixture and the tiny model alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Modules = Callable[[Any], Sequence[Any]]


@dataclass(frozen=True)
class ModelHalf:
    """What the project needs to know about one trainable half of GLM-Image."""

    component: str  # the config's and the checkpoint's name for it: "dit" | "ar"
    attribute: str  # the GlmImagePipeline attribute holding it
    weights_key: str  # the config key that gives it trained weights when the other half trains
    # Folders besides its own that decide its output (the AR model's prompts go through the processor).
    companion_folders: tuple[str, ...]
    # The parts the training forward uses: full fine-tuning trains these, every other weight stays frozen.
    trained_parts: Modules
    layers: Modules  # the repeated layers (one FSDP unit each; the memory plan's layer count)
    # FSDP units besides the root (a unit is gathered whole when it runs): the layers, plus parts a
    # text-to-image forward never runs, which as units of their own stay sharded instead of being gathered
    # at every forward inside the root.
    shard_units: Modules
    unused_units: Modules  # the shard units text-to-image never runs: sampling leaves them sharded
    # Bytes saved for backward per token per unit of hidden width by one layer in a bf16-autocast LoRA
    # training forward, and with gradient checkpointing (`plan/`, `benchmarks/bench_memory.py --calibrate`).
    activation_coef: float
    checkpoint_coef: float
    # The sampling-config keys holding the number of decoder steps and the guidance scale the images of a
    # run of this half are rendered with (evaluation defaults to them).
    render_keys: tuple[str, str]

    def render_settings(self, sampling: Any) -> tuple[int, float]:
        """(decoder steps, guidance scale) of a run's sampling config."""
        steps, guidance = self.render_keys
        return getattr(sampling, steps), getattr(sampling, guidance)


def _image_input_towers(ar_model: Any) -> list[Any]:
    """The AR model's vision encoder and VQ tokenizer: they read input images; text-to-image has none."""
    return [ar_model.model.visual, ar_model.model.vqmodel]


DIT = ModelHalf(
    component="dit",
    attribute="transformer",
    weights_key="model.dit_weights",
    companion_folders=(),
    trained_parts=lambda module: [module],
    layers=lambda module: list(module.transformer_blocks),  # GlmImageTransformerBlock
    shard_units=lambda module: list(module.transformer_blocks),
    unused_units=lambda module: [],
    # Measured on the real-width fixture: 35.0 at 256² (256 tokens), 32.9 at 512² (1024 tokens); with
    # checkpointing a layer keeps only its bf16 input (2.0 to 2.1).
    activation_coef=34.0,
    checkpoint_coef=2.1,
    render_keys=("num_steps", "guidance_scale"),
)

AR = ModelHalf(
    component="ar",
    attribute="vision_language_encoder",
    weights_key="model.ar_weights",
    companion_folders=("processor",),
    # Text-to-image runs only the GLM decoder and its image-token head; the vision tower and the VQ
    # tokenizer (for image inputs) stay frozen.
    trained_parts=lambda module: [module.model.language_model, module.lm_head],
    layers=lambda module: list(module.get_decoder().layers),
    shard_units=lambda module: [*module.get_decoder().layers, *_image_input_towers(module)],
    unused_units=lambda module: _image_input_towers(module),
    # Measured: 48.9 (384 tokens), 48.7 (576 tokens); 2.0 with checkpointing.
    activation_coef=48.8,
    checkpoint_coef=2.0,
    # The AR trainer renders its samples with the frozen DiT's own settings.
    render_keys=("dit_num_steps", "dit_guidance_scale"),
)

HALVES: dict[str, ModelHalf] = {half.component: half for half in (DIT, AR)}


def model_half(component: str) -> ModelHalf:
    """The description of `component` ("dit" or "ar")."""
    try:
        return HALVES[component]
    except KeyError:
        raise ValueError(f"component must be one of {sorted(HALVES)}, got '{component}'.") from None


def pipeline_attribute(component: str) -> str:
    """ "transformer" or "vision_language_encoder": the pipeline attribute of `component`."""
    return model_half(component).attribute


__all__ = ["AR", "DIT", "HALVES", "ModelHalf", "model_half", "pipeline_attribute"]

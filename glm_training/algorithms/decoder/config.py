"""The `sampling` section every decoder algorithm has: resolution, steps, guidance, micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

from glm_training.config.options import _check, check_resolution, option


@dataclass
class DiffusionSamplingConfig:
    """The DiT rollout: what every decoder algorithm's sampling has (DiffusionNFT: its ODE sampler)."""

    height: int = option(64, "image height in pixels, a multiple of 32")
    width: int = option(64, "image width in pixels, a multiple of 32")
    num_steps: int = option(10, "denoising steps of the rollout")
    guidance_scale: float = option(1.5, "classifier-free guidance of the DiT (<= 1 disables it)")
    batched_cfg: bool = option(
        False,
        (
            "Conditional and unconditional CFG passes in one DiT forward of 2B samples (rollout "
            "and training). Off by default: GLM-Image's DiT takes no text mask, so padding the "
            "empty prompt's glyph embeddings to the prompt's length changes the unconditional "
            "prediction slightly (docs/benchmarks.md)."
        ),
    )
    micro_batch_size: int = option(4, "images per DiT forward pass during the rollout")

    def __post_init__(self) -> None:
        check_resolution(self.height, self.width)
        _check(self.num_steps >= 2, "sampling.num_steps", "must be >= 2 (the last step is deterministic).")
        _check(self.guidance_scale >= 0, "sampling.guidance_scale", "must be >= 0 (<= 1 disables CFG).")
        _check(self.micro_batch_size >= 1, "sampling.micro_batch_size", "must be >= 1.")

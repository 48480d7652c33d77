"""What differs between the halves in the plan: one micro-batch of the trained forward, and the buffers.

A small per-component table (`_TOKENS`, `_WORKLOADS`) gives, for the DiT and the AR model, the tokens of
one sequence, the micro-batch, the hidden width, the AR loss's log-softmax and the trajectory buffers the
rollout keeps; the activation and rollout terms (`transients.py`) multiply them out. What the halves share
as data (layers, activation coefficients) is read from their `ModelHalf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from glm_training.plan.report import Term

# The AR loss keeps the float32 log-softmax over the image vocabulary of every scored token (measured: exactly
# one copy saved); its gradient is a second copy during backward.
AR_LOGIT_COPIES = 2


@dataclass(frozen=True)
class Workload:
    """One micro-batch of the trained forward, and the trajectory buffers of a rank's samples."""

    batch: int  # sequences per training forward (the DiT's CFG doubles them)
    tokens: int  # tokens per sequence
    width: int  # hidden width of the trained layers
    logits: float  # bytes of the AR loss's log-softmax (and its gradient); 0 for the DiT
    decode_batch: int  # images per VAE decode of the rollout
    buffers: Term  # trajectory buffers


def _vae_factor(modules: dict[str, nn.Module]) -> int:
    return 2 ** (len(modules["vae"].config.block_out_channels) - 1)


def _dit_tokens(height: int, width: int, modules: dict[str, nn.Module]) -> tuple[int, int]:
    dit = modules["transformer"].config
    vae_factor = _vae_factor(modules)
    latent_tokens = (height // vae_factor // dit.patch_size) * (width // vae_factor // dit.patch_size)
    return latent_tokens, 0


def _ar_tokens(height: int, width: int, modules: dict[str, nn.Module]) -> tuple[int, int]:
    # AR: the prompt (~ 64 tokens), the 16 x 16 preview grid, the large (H/32) x (W/32) grid.
    generated = (height // 32) * (width // 32) + 256
    return 64 + generated, generated


_TOKENS = {"dit": _dit_tokens, "ar": _ar_tokens}


def sequence_tokens(
    component: str, height: int, width: int, modules: dict[str, nn.Module]
) -> tuple[int, int]:
    """(tokens per sample of the trained forward, tokens whose logits are scored) at `height x width`."""
    return _TOKENS[component](height, width, modules)


def _dit_workload(cfg: Any, modules: dict[str, nn.Module], world_size: int) -> Workload:
    s = cfg.sampling
    tokens, _ = _dit_tokens(s.height, s.width, modules)
    trained = modules["transformer"].config
    vae_factor = _vae_factor(modules)
    latent = modules["vae"].config.latent_channels * (s.height // vae_factor) * (s.width // vae_factor)
    kept, kept_what = cfg.rollout_latents_per_sample()
    samples = cfg.data.per_rank_samples(world_size)
    return Workload(
        batch=s.micro_batch_size * (2 if s.guidance_scale > 1 else 1),  # CFG: two forwards with graphs
        tokens=tokens,
        width=trained.num_attention_heads * trained.attention_head_dim,
        logits=0.0,
        decode_batch=s.micro_batch_size,
        buffers=Term(
            "trajectory buffers", samples * kept * latent * 4, f"{samples} samples x {kept_what}, float32"
        ),
    )


def _ar_workload(cfg: Any, modules: dict[str, nn.Module], world_size: int) -> Workload:
    s = cfg.sampling
    tokens, scored = _ar_tokens(s.height, s.width, modules)
    text = modules["vision_language_encoder"].config.text_config
    batch = cfg.algo.micro_batch_size
    samples = cfg.data.per_rank_samples(world_size)
    return Workload(
        batch=batch,
        tokens=tokens,
        width=text.hidden_size,
        logits=batch * scored * text.vision_vocab_size * 4 * AR_LOGIT_COPIES,
        decode_batch=cfg.algo.micro_batch_size,
        buffers=Term("trajectory buffers", samples * tokens * 8 * 4, "token ids, masks, positions"),
    )


_WORKLOADS = {"dit": _dit_workload, "ar": _ar_workload}


def workload(cfg: Any, modules: dict[str, nn.Module], world_size: int) -> Workload:
    """The micro-batch and buffers of `cfg.component`'s training at the sampling resolution."""
    return _WORKLOADS[cfg.component](cfg, modules, world_size)

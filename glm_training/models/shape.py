"""A real-width GLM-Image with random weights and few layers: ``model=glm_image_shape``.

The tiny model (``tiny.py``) proves the logic; this fixture proves the sizes. Every component has the real
checkpoint's widths, vocabularies and token counts (so a 1024² prompt-to-image run moves real-sized tensors),
only the layer stacks are cut to ``num_ar_layers`` / ``num_dit_layers`` (default 1). The same configs with
the real layer counts (40 AR layers, 30 DiT blocks) are what `glm_training.plan` sizes the real model from,
on the meta device, without any weights.

Where each value comes from (checked against the checkpoint's config files through public mirrors of
``zai-org/GLM-Image``, January 2026):

* ``vision_language_encoder/config.json`` (read from ``zai-org/GLM-Image``): text hidden 4096, FFN 13696,
  40 layers, 32 heads / 2 KV heads, vocabulary 168064, vision vocabulary 16512, M-RoPE sections (8, 12, 12)
  with partial rotary 0.5, max positions 131072, image start/end 16384/16385, image token 167855, pad 167841;
  vision tower depth 40, width 1536, 16 heads, FFN 6144, patch 16, image size 2048. transformers'
  ``GlmImageConfig()`` defaults carry the same values, and its ``vq_config`` defaults are used as they are
  (the mirror's text was cut off inside ``vq_config``: embed_dim 2048 verified, the rest NOT verified).
* ``transformer/config.json`` (mirrors ``xcreates/GLM-Image`` and ``Intel/GLM-Image-int4-AutoRound``, which
  agree): patch 2, 16 in/out channels, 30 layers, 32 heads x 128, text_embed_dim 1472, time_embed_dim 512,
  condition_dim 256, prior codebook 16384. diffusers' constructor defaults (64 heads x 40) are not these.
* ``text_encoder`` (the ByT5 glyph encoder): width 1472 is verified (the DiT's text_embed_dim); the rest is
  ``google/byt5-small``'s encoder (12 layers, 6 heads x 64, gated-GELU FFN 3584, vocabulary 384), on which
  Glyph-ByT5 is built. NOT verified against GLM-Image's own ``text_encoder/config.json``.
* ``vae``: 16 latent channels and scale factor 8 are verified (the pipeline's latent grid); the block widths
  (128, 512, 1024, 1024) with 3 layers per block are CogView4's VAE, which the DiT descends from, and the
  per-channel latent statistics are neutral (mean 0, std 1). NOT verified against GLM-Image's own
  ``vae/config.json``.

The AR tokenizer is the tiny model's byte-level one plus the real special-token ids: the embedding keeps the
real 168064 rows, the visual tokens sit at their real ids [0, 16386), the text bytes and specials at ids
placed where the real ones are not used; texts therefore tokenise to one id per byte, which changes only the
prompt length, not any width.

Weights are saved in bfloat16 (the AR embedding alone is 0.69B parameters, 1.4 GB) and built under a
bfloat16 default dtype, so building never holds an fp32 copy. One AR layer is ~0.2B parameters, one DiT block
~0.2B. The folder is cached like the tiny one (``tiny.ensure_built``: atomic, safe under concurrent ranks).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator

import torch
from diffusers import AutoencoderKL, GlmImagePipeline, GlmImageTransformer2DModel
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import (
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageImageProcessorPil,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from glm_training.models import tiny

SHAPE_MODEL_VERSION: int = 4
"""Bump whenever a change here alters the saved folder; it is part of the cache directory name."""

SHAPE_MODEL_NAME = "glm_image_shape"

# The fixture's weights: biases 0, norm scales 1, everything else N(0, INIT_STD) values read from one seeded
# block of BLOCK_LENGTH (2^20 - 3, prime: no row of a matrix narrower than it repeats another) at an offset
# per tensor (`init_parameters_`).
INIT_STD = 0.02
BLOCK_LENGTH = 1_048_573

# The real checkpoint's layer counts (the fixture keeps 1 of each by default).
REAL_NUM_AR_LAYERS = 40
REAL_NUM_DIT_LAYERS = 30
REAL_NUM_VISION_LAYERS = 40
REAL_NUM_GLYPH_LAYERS = 12

# Real token ids (vision_language_encoder/config.json).
NUM_VQ_CODES = 16384
IMAGE_START_TOKEN_ID = 16384
IMAGE_END_TOKEN_ID = 16385
VISION_VOCAB_SIZE = 16512
VOCAB_SIZE = 168064
IMAGE_TOKEN_ID = 167855
PAD_TOKEN_ID = 167841
# Text ids of the fixture's byte tokenizer: 256 bytes from here, then <sop>, <eop>. Unused range of the real
# vocabulary's layout as far as the fixture is concerned (only its size matters).
FIRST_BYTE_TOKEN_ID = 20000

AR_TEXT_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "vision_vocab_size": VISION_VOCAB_SIZE,
    "hidden_size": 4096,
    "intermediate_size": 13696,
    "num_hidden_layers": REAL_NUM_AR_LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "attention_bias": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [8, 12, 12],
    },
    "pad_token_id": PAD_TOKEN_ID,
    "eos_token_id": IMAGE_END_TOKEN_ID,
}
AR_VISION_CONFIG = {
    "depth": REAL_NUM_VISION_LAYERS,
    "hidden_size": 1536,
    "num_heads": 16,
    "intermediate_size": 6144,
    "patch_size": 16,
    "image_size": 2048,
    "attention_bias": True,
    "spatial_merge_size": 1,
}
DIT_CONFIG = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": REAL_NUM_DIT_LAYERS,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "text_embed_dim": 1472,
    "time_embed_dim": 512,
    "condition_dim": 256,
    "prior_vq_quantizer_codebook_size": NUM_VQ_CODES,
}
GLYPH_CONFIG = {  # google/byt5-small's encoder at GLM-Image's glyph width 1472 (layout not verified)
    "vocab_size": 384,
    "d_model": 1472,
    "d_kv": 64,
    "d_ff": 3584,
    "num_layers": REAL_NUM_GLYPH_LAYERS,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
VAE_CONFIG = {  # CogView4's VAE layout (not verified for GLM-Image); 16 latent channels, scale factor 8
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 512, 1024, 1024],
    "layers_per_block": 3,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
    # The pipeline (de)normalises latents per channel with these; the real statistics are not verified, so the
    # fixture uses the neutral ones.
    "latents_mean": [0.0] * 16,
    "latents_std": [1.0] * 16,
}


def glm_image_config(num_ar_layers: int = REAL_NUM_AR_LAYERS, num_vision_layers: int = 1) -> GlmImageConfig:
    """The AR model's config (``vision_language_encoder``) at real widths with the given layer counts."""
    return GlmImageConfig(
        text_config={**AR_TEXT_CONFIG, "num_hidden_layers": num_ar_layers},
        vision_config={**AR_VISION_CONFIG, "depth": num_vision_layers},
        image_token_id=IMAGE_TOKEN_ID,
        image_start_token_id=IMAGE_START_TOKEN_ID,
        image_end_token_id=IMAGE_END_TOKEN_ID,
    )


def dit_config(num_dit_layers: int = REAL_NUM_DIT_LAYERS) -> dict:
    return {**DIT_CONFIG, "num_layers": num_dit_layers}


def glyph_config(num_glyph_layers: int = REAL_NUM_GLYPH_LAYERS) -> T5Config:
    return T5Config(**{**GLYPH_CONFIG, "num_layers": num_glyph_layers})


def _build_ar_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with GLM-Image's special tokens at their real ids (see the module docstring)."""
    vocab = {f"<|dit_token_{i}|>": i for i in range(IMAGE_END_TOKEN_ID + 1)}
    for i, symbol in enumerate(tiny._byte_symbols()):
        vocab[symbol] = FIRST_BYTE_TOKEN_ID + i
    vocab[tiny.GRID_BOS_TOKEN] = FIRST_BYTE_TOKEN_ID + 256
    vocab[tiny.GRID_EOS_TOKEN] = FIRST_BYTE_TOKEN_ID + 257
    vocab[tiny.IMAGE_TOKEN] = IMAGE_TOKEN_ID
    vocab[tiny.PAD_TOKEN] = PAD_TOKEN_ID
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [f"<|dit_token_{i}|>" for i in range(IMAGE_END_TOKEN_ID + 1)]
    specials += [tiny.IMAGE_TOKEN, tiny.GRID_BOS_TOKEN, tiny.GRID_EOS_TOKEN, tiny.PAD_TOKEN]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=f"<|dit_token_{IMAGE_START_TOKEN_ID}|>",
        eos_token=f"<|dit_token_{IMAGE_END_TOKEN_ID}|>",
        pad_token=tiny.PAD_TOKEN,
        extra_special_tokens={
            "image_token": tiny.IMAGE_TOKEN,
            "grid_bos_token": tiny.GRID_BOS_TOKEN,
            "grid_eos_token": tiny.GRID_EOS_TOKEN,
        },
        padding_side="left",
    )


def _build_processor() -> GlmImageProcessor:
    image_processor = GlmImageImageProcessorPil(
        patch_size=AR_VISION_CONFIG["patch_size"], temporal_patch_size=1, merge_size=1
    )
    tokenizer = _build_ar_tokenizer()
    template = tiny.CHAT_TEMPLATE.replace(tiny.IMAGE_START_TOKEN, tokenizer.bos_token).replace(
        tiny.IMAGE_END_TOKEN, tokenizer.eos_token
    )
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith("Norm")


@torch.no_grad()
def init_parameters_(module: nn.Module, block: torch.Tensor, salt: int) -> None:
    """Biases 0, norm scales 1, every other parameter filled with the seeded block from its own offset.

    `block` [2 * BLOCK_LENGTH]: N(0, INIT_STD) values, the first half repeated, on the module's device.
    """
    count = 0
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False):
            if name.endswith("bias"):
                param.zero_()
            elif _is_norm(sub):
                param.fill_(1.0)
            else:
                count += 1
                offset = (salt * 1_000_003 + count * 7_919) % BLOCK_LENGTH
                flat = param.view(-1)
                done = 0
                while done < flat.numel():
                    take = min(BLOCK_LENGTH, flat.numel() - done)
                    flat[done : done + take].copy_(block[offset : offset + take])
                    done += take
                    offset = (offset + take) % BLOCK_LENGTH


def materialise(
    factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype, block: torch.Tensor, salt: int
) -> nn.Module:
    """`factory()` with its parameters on the meta device, then allocated on `device` and initialised.

    Buffers (rotary frequencies) are computed on the CPU at construction, as the libraries do, and copied
    over: `to_empty` would leave them uninitialised.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False), _default_dtype(dtype):
        module = factory()
    buffers = dict(module.named_buffers())
    module.to_empty(device=device)
    if hasattr(module, "tie_weights"):
        module.tie_weights()  # to_empty gives tied parameters (T5's shared embedding) separate storage
    init_parameters_(module, block.to(device=device, dtype=dtype), salt)
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)
    return module


def build_shape_pipeline(
    num_ar_layers: int = 1, num_dit_layers: int = 1, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> GlmImagePipeline:
    """The real-width pipeline with ``num_ar_layers`` AR decoder layers and ``num_dit_layers`` DiT blocks.

    The vision tower and the glyph encoder keep one layer each (frozen, and unused by text-to-image apart from
    the glyph encoder's one pass per prompt). Weights are created directly in ``dtype`` (`build_components`).
    """
    layers = {"ar": num_ar_layers, "vision": 1, "dit": num_dit_layers, "glyph": 1}
    with tiny._BUILD_LOCK:
        return finish_shape_pipeline(**build_components(layers, torch.device("cpu"), dtype, seed))


def build_components(
    layers: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, nn.Module]:
    """The four weight-holding components at real widths with `layers` ({"ar", "vision", "dit", "glyph"})
    layers per stack, built on the meta device, then allocated on `device` in `dtype` and initialised
    (`init_parameters_`): no weight is ever created twice or anywhere else (the libraries' own initialisers
    took ~20 s for one layer per stack on a 2-core CPU, in bf16; this, ~1 s). Returns the keyword arguments of
    `finish_shape_pipeline`."""
    factories = {
        "text_encoder": lambda: T5EncoderModel(glyph_config(layers["glyph"])),
        "ar": lambda: GlmImageForConditionalGeneration(glm_image_config(layers["ar"], layers["vision"])),
        "vae": lambda: AutoencoderKL(**VAE_CONFIG),
        "transformer": lambda: GlmImageTransformer2DModel(**dit_config(layers["dit"])),
    }
    generator = torch.Generator().manual_seed(seed)
    half = torch.randn(BLOCK_LENGTH, generator=generator) * INIT_STD
    block = torch.cat([half, half]).to(device=device, dtype=dtype)
    return {
        name: materialise(factory, device, dtype, block, salt)
        for salt, (name, factory) in enumerate(factories.items())
    }


def finish_shape_pipeline(
    text_encoder: T5EncoderModel,
    ar: GlmImageForConditionalGeneration,
    vae: AutoencoderKL,
    transformer: GlmImageTransformer2DModel,
) -> GlmImagePipeline:
    """The fixture's pipeline around its four weight-holding components, built by the caller at any depth, on
    any device (`build_shape_pipeline`: on the CPU; `glm_training.gpu_check`: on the meta device, then
    materialised on the GPU): the AR head's rows outside the codebook zeroed, the AR generation config, the
    offline processor and glyph tokenizer, GLM-Image's scheduler."""
    processor = _build_processor()
    # The trained model writes only codebook tokens inside an image; random weights would also write the
    # vision vocabulary's other entries (image start / end, ...: ids >= 16384), which are no DiT prior token
    # (an IndexError in its prior embedding) and, sampled or not, depend on the CPU's rounding. Their output
    # rows are zero, so their logit is exactly 0 while the codebook's spread around it: under the sampling's
    # top-k 50 none of them is ever drawn.
    with torch.no_grad():
        ar.lm_head.weight[NUM_VQ_CODES:].zero_()
    gen = ar.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = (
        PAD_TOKEN_ID,
        IMAGE_START_TOKEN_ID,
        IMAGE_END_TOKEN_ID,
    )
    gen.do_sample, gen.temperature, gen.top_p = True, tiny.AR_TEMPERATURE, tiny.AR_TOP_P
    return tiny.assemble_pipeline(processor, text_encoder, ar, vae, transformer)


def shape_folder_name(num_ar_layers: int, num_dit_layers: int, seed: int) -> str:
    return f"glm-image-shape-v{SHAPE_MODEL_VERSION}-ar{num_ar_layers}-dit{num_dit_layers}-seed{seed}"


def ensure_shape_pipeline(
    num_ar_layers: int = 1,
    num_dit_layers: int = 1,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> pathlib.Path:
    """The cached folder of the fixture (built on first use, ~3.5 GB with one layer per stack)."""
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else tiny.default_cache_dir()
    target = cache_dir / shape_folder_name(num_ar_layers, num_dit_layers, seed)

    def save(folder: pathlib.Path) -> None:
        pipe = build_shape_pipeline(num_ar_layers, num_dit_layers, seed)
        pipe.save_pretrained(folder, safe_serialization=True)

    marker = {"version": SHAPE_MODEL_VERSION, "ar": num_ar_layers, "dit": num_dit_layers, "seed": seed}
    return tiny.ensure_built(target, save, marker, f"real-width GLM-Image fixture {marker}")

"""A tiny random-weight GLM-Image pipeline, built offline, for tests and CPU smoke runs.

GLM-Image (``zai-org/GLM-Image``) is a two-stage text-to-image model: an autoregressive (AR) GLM
model samples discrete "prior" image tokens on a coarse grid, and a flow-matching DiT decodes VAE
latents conditioned on those tokens and on ByT5 glyph embeddings of the quoted text in the prompt.
`diffusers.GlmImagePipeline` wires seven components together; this module builds every one of them
from a config with a few thousand parameters each, so the whole RL stack (rollouts, log-probs,
losses, checkpoints, multi-rank runs) can be exercised on CPU without downloading anything.

The components are the real library classes, not stand-ins: the saved folder reloads with plain
``diffusers.GlmImagePipeline.from_pretrained(path)``. Only the sizes are shrunk. Two choices differ
on purpose from the real checkpoint and are worth knowing when reading AR log-probs:

* Token-id layout. The real text vocabulary starts with the visual tokens ``<|dit_token_i|>``:
  ids ``[0, 16384)`` are VQ codebook entries, 16384 is image-start (the tokenizer's ``bos``) and
  16385 image-end (``eos``); the AR ``lm_head`` has ``vision_vocab_size = 16512`` outputs. Here the
  codebook has ``NUM_VISION_TOKENS = 128`` entries, image-start is id 128 and image-end id 129, and the
  ``lm_head`` has exactly 128 outputs, one per codebook entry.
* Consequently the tiny AR model can never sample image-start/image-end (or any id the DiT's
  128-entry prior embedding cannot look up). ``generate()`` therefore always runs for exactly
  ``max_new_tokens`` steps, which the pipeline relies on when it slices the large grid out of the
  output. The real model *can* sample ids >= 16384 (they are inside its 16512 logits); nothing in
  transformers or diffusers masks them, only training makes them improbable.

The AR tokenizer is a byte-level BPE without merges (one token per UTF-8 byte) that carries the
special tokens ``GlmImageProcessor`` reads, and a chat template that mirrors the real one's layout
as far as the processor and ``GlmImageModel.get_rope_index`` reveal it: text is emitted verbatim and
each input image becomes ``<image-start><|image|><image-end>`` (the processor then expands
``<|image|>`` to one placeholder per vision patch and appends the target-grid suffix).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile
import uuid

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    GlmImagePipeline,
    GlmImageTransformer2DModel,
)
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    ByT5Tokenizer,
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageImageProcessorPil,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

logger = logging.getLogger(__name__)

TINY_MODEL_VERSION: int = 1
"""Bump whenever anything below changes the saved folder; it is part of the cache directory name."""

# --- Token-id layout of the AR vocabulary (see module docstring). -----------------------------------
NUM_VISION_TOKENS = 128  # VQ codebook size == AR lm_head width == DiT prior vocabulary
IMAGE_START_TOKEN_ID = NUM_VISION_TOKENS  # real: 16384
IMAGE_END_TOKEN_ID = NUM_VISION_TOKENS + 1  # real: 16385
IMAGE_START_TOKEN = f"<|dit_token_{IMAGE_START_TOKEN_ID}|>"
IMAGE_END_TOKEN = f"<|dit_token_{IMAGE_END_TOKEN_ID}|>"
IMAGE_TOKEN = "<|image|>"  # placeholder the processor expands to one token per source-image patch
GRID_BOS_TOKEN = "<sop>"  # opens a "<sop>H W<eop>" target-grid size hint
GRID_EOS_TOKEN = "<eop>"
PAD_TOKEN = "<|endoftext|>"

# Sampling parameters of the real checkpoint's generation_config, as reported by a third-party port
# (temperature 0.9, top-p 0.75). The pipeline only passes do_sample=True, so these are what shape
# the AR policy; log-prob recomputation must apply the same logits processing.
AR_TEMPERATURE = 0.9
AR_TOP_P = 0.75

# Vision tower patch size; the image processor must cut patches of the same size.
VISION_PATCH_SIZE = 8
T5_D_MODEL = 32

# Layout of the real chat template as inferred from GlmImageProcessor / get_rope_index: no role
# markers; source images are bracketed by image-start/image-end so get_rope_index can find them.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}" + IMAGE_START_TOKEN + IMAGE_TOKEN + IMAGE_END_TOKEN + "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)

_COMPLETE_MARKER = ".complete"


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, num_shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return [symbols[byte] for byte in range(256)]


def _build_ar_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with GLM-Image's special tokens, built without any files.

    Ids: ``[0, 130)`` visual tokens ``<|dit_token_i|>`` (codebook, image-start, image-end), then the
    256 byte symbols, then ``<|image|>``, ``<sop>``, ``<eop>`` and the pad token.
    """
    visual_tokens = [f"<|dit_token_{i}|>" for i in range(IMAGE_END_TOKEN_ID + 1)]
    byte_symbols = _byte_symbols()
    text_specials = [IMAGE_TOKEN, GRID_BOS_TOKEN, GRID_EOS_TOKEN, PAD_TOKEN]
    vocab = {token: i for i, token in enumerate(visual_tokens + byte_symbols + text_specials)}

    # No merges: every byte is one token, which keeps the vocabulary (and the AR embedding) tiny.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Registering the specials makes them atomic (never split into bytes); they keep their vocab ids.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in visual_tokens + text_specials]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IMAGE_START_TOKEN,
        eos_token=IMAGE_END_TOKEN,
        pad_token=PAD_TOKEN,
        # GlmImageProcessor.__init__ reads these as tokenizer attributes; a dict of named extra special
        # tokens is what makes transformers expose, save and reload them as attributes.
        extra_special_tokens={
            "image_token": IMAGE_TOKEN,
            "grid_bos_token": GRID_BOS_TOKEN,
            "grid_eos_token": GRID_EOS_TOKEN,
        },
        # The pipeline batches prompts with padding=True and slices generated tokens at the common
        # input length, which is only correct with left padding.
        padding_side="left",
    )


def _build_processor() -> GlmImageProcessor:
    image_processor = GlmImageImageProcessorPil(
        patch_size=VISION_PATCH_SIZE,
        # GlmImageVisionPatchEmbed reshapes pixels to (-1, C, patch, patch): one frame, no merging.
        temporal_patch_size=1,
        merge_size=1,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},  # pixel-count bounds for sources
    )
    return GlmImageProcessor(
        image_processor=image_processor, tokenizer=_build_ar_tokenizer(), chat_template=CHAT_TEMPLATE
    )


def _build_text_encoder() -> T5EncoderModel:
    """ByT5-style glyph encoder; its vocabulary matches ByT5Tokenizer's 384 ids."""
    config = T5Config(
        vocab_size=384,
        d_model=T5_D_MODEL,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config)


def _build_vision_language_encoder(tokenizer: PreTrainedTokenizerFast) -> GlmImageForConditionalGeneration:
    pad_token_id = tokenizer.pad_token_id
    vision_hidden_size = 32
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "vision_vocab_size": NUM_VISION_TOKENS,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # grouped-query attention, as in the real 32/2 heads
            "max_position_embeddings": 1024,
            # Real: head_dim 128, partial rotary 0.5, mrope_section (8, 12, 12) over 32 frequencies.
            # Here head_dim 32 -> 8 rotary frequencies split (t, h, w) = (2, 3, 3).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 3, 3],
            },
            "pad_token_id": pad_token_id,
            "eos_token_id": IMAGE_END_TOKEN_ID,
        },
        vision_config={
            "depth": 2,
            "hidden_size": vision_hidden_size,
            "num_heads": 2,
            "intermediate_size": 64,
            "image_size": 32,  # 4x4 learned position grid, bilinearly resampled to any patch grid
            "patch_size": VISION_PATCH_SIZE,
            "spatial_merge_size": 1,
        },
        # The VQ quantiser reads vision-tower features directly, so latent_channels == vision hidden.
        vq_config={"embed_dim": 32, "num_embeddings": NUM_VISION_TOKENS, "latent_channels": vision_hidden_size},
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_start_token_id=IMAGE_START_TOKEN_ID,
        image_end_token_id=IMAGE_END_TOKEN_ID,
    )
    model = GlmImageForConditionalGeneration(config)
    generation_config = model.generation_config
    generation_config.pad_token_id = pad_token_id
    generation_config.bos_token_id = IMAGE_START_TOKEN_ID
    generation_config.eos_token_id = IMAGE_END_TOKEN_ID
    generation_config.do_sample = True
    generation_config.temperature = AR_TEMPERATURE
    generation_config.top_p = AR_TOP_P
    return model


def _build_vae(generator: torch.Generator) -> AutoencoderKL:
    latent_channels = 16  # as the real GLM-Image VAE
    # Non-trivial per-channel statistics, so a missing (de)normalisation shows up in tests.
    latents_mean = (0.1 * torch.randn(latent_channels, generator=generator)).tolist()
    latents_std = (0.5 + torch.rand(latent_channels, generator=generator)).tolist()
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        # Four levels -> vae_scale_factor 8, which with DiT patch 2 gives the d16 grid that the 2x
        # upsampled d32 AR tokens cover.
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=latent_channels,
        sample_size=32,
        latents_mean=[round(x, 6) for x in latents_mean],
        latents_std=[round(x, 6) for x in latents_std],
    )


def _build_transformer(latent_channels: int) -> GlmImageTransformer2DModel:
    return GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=T5_D_MODEL,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=NUM_VISION_TOKENS,
    )


def _build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # The pipeline computes mu = sqrt(seq_len / 256) * 0.75 + 0.25 itself; "linear" applies it as
    # sigma' = mu / (mu + (1 / sigma - 1)), the shift GLM-Image's ports reproduce.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="linear",
    )


def build_tiny_pipeline(seed: int = 0) -> GlmImagePipeline:
    """Build the tiny pipeline in fp32 on CPU; identical weights for identical ``seed``.

    The global torch RNG is left untouched (the build runs inside ``fork_rng``).
    """
    with torch.random.fork_rng(devices=[]):
        # One derived seed per component, so resizing one component leaves the others' weights alone.
        def seeded(offset: int) -> None:
            torch.manual_seed(seed * 1000 + offset)

        processor = _build_processor()
        seeded(1)
        text_encoder = _build_text_encoder()
        seeded(2)
        vision_language_encoder = _build_vision_language_encoder(processor.tokenizer)
        seeded(3)
        vae = _build_vae(torch.Generator().manual_seed(seed * 1000 + 4))
        seeded(5)
        transformer = _build_transformer(vae.config.latent_channels)

    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=vision_language_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=_build_scheduler(),
    )
    for module in (text_encoder, vision_language_encoder, vae, transformer):
        module.eval()
    return pipe


def save_tiny_pipeline(path: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny pipeline and ``save_pretrained`` it (safetensors) into ``path``."""
    path = pathlib.Path(path)
    build_tiny_pipeline(seed).save_pretrained(path, safe_serialization=True)
    return path


def default_cache_dir() -> pathlib.Path:
    """``$GLM_TRAINING_CACHE`` if set, else ``~/.cache/glm_training``."""
    env = os.environ.get("GLM_TRAINING_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "glm_training"


def _is_complete(folder: pathlib.Path) -> bool:
    return (folder / "model_index.json").is_file() and (folder / _COMPLETE_MARKER).is_file()


def ensure_tiny_pipeline(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Return ``<cache_dir>/tiny-glm-image-v{TINY_MODEL_VERSION}-seed{seed}``, building it once.

    Safe for several processes at once (e.g. torchrun ranks): each builds into a private temporary
    sibling and renames it into place; a rank that loses the race discards its copy. A folder counts
    as complete only when its marker file, written last, exists.
    """
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"tiny-glm-image-v{TINY_MODEL_VERSION}-seed{seed}"
    if _is_complete(target):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Building tiny GLM-Image pipeline (seed %d) into %s", seed, target)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-{uuid.uuid4().hex[:8]}-", dir=cache_dir))
    try:
        save_tiny_pipeline(staging, seed)
        (staging / _COMPLETE_MARKER).write_text(json.dumps({"version": TINY_MODEL_VERSION, "seed": seed}))
        if target.exists() and not _is_complete(target):
            # Left behind by a crashed run that renamed but never finished? Renames are atomic, so
            # an incomplete target can only come from outside this function; replace it.
            logger.warning("Replacing incomplete tiny pipeline folder %s", target)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its complete copy into place first.
            if not _is_complete(target):
                raise
            logger.info("Another process built %s first; discarding this copy", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

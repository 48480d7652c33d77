"""A tiny random-weight GLM-Image pipeline, built offline, for tests and CPU smoke runs.

GLM-Image (``zai-org/GLM-Image``) generates an image in two stages: an autoregressive (AR) GLM
model samples discrete "prior" tokens on a coarse grid, then a flow-matching DiT denoises VAE
latents conditioned on those tokens and on ByT5 glyph embeddings of the quoted text in the prompt.
``diffusers.GlmImagePipeline`` joins seven components; this module builds each of them from a config
with 30k to 140k parameters (about 1.2 MB saved), so that rollouts, log-probs, losses, checkpoints
and multi-rank runs can all be exercised on CPU without downloading anything.

The components are the real library classes, only shrunk: the saved folder reloads with plain
``diffusers.GlmImagePipeline.from_pretrained(path)``. One deliberate difference from the real
checkpoint, and its consequence, matter when reading AR log-probs:

* Token-id layout. The real AR vocabulary starts with the visual tokens ``<|dit_token_i|>``: ids
  ``[0, 16384)`` are VQ codebook entries, 16384 is image-start (the tokenizer's ``bos``), 16385 is
  image-end (``eos``), and the ``lm_head`` has ``vision_vocab_size = 16512`` outputs. Here the
  codebook has ``NUM_VISION_TOKENS = 128`` entries, image-start is id 128, image-end id 129, and the
  ``lm_head`` has exactly 128 outputs, one per codebook entry.
* Hence the tiny AR model cannot sample image-end (nor any id outside the DiT's 128-entry prior
  embedding), so ``generate()`` always runs for exactly ``max_new_tokens`` steps, which the pipeline
  relies on when it slices the large grid out of the output. The real model can sample ids >= 16384
  (they are among its 16512 logits); neither transformers nor diffusers masks them, only training
  makes them improbable. This is the same trick the diffusers test suite uses for its tiny model.

The AR tokenizer is a byte-level BPE without merges (one token per UTF-8 byte) that carries the
special tokens ``GlmImageProcessor`` reads. Its chat template follows the real one's layout as far as
``GlmImageProcessor`` and ``GlmImageModel.get_rope_index`` reveal it: text verbatim, no role markers,
and each source image written as ``<image-start><|image|><image-end>``. The processor then expands
``<|image|>`` to one placeholder per vision patch and appends the target-grid suffix
``<sop>H W<eop><sop>h w<eop><image-start>``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable

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

TINY_MODEL_VERSION: int = 2
"""Bump whenever a change here alters the saved folder; it is part of the cache directory name."""

# Token-id layout of the AR vocabulary (see the module docstring).
NUM_VISION_TOKENS = 128  # VQ codebook size == AR lm_head width == DiT prior vocabulary
IMAGE_START_TOKEN_ID = NUM_VISION_TOKENS  # real checkpoint: 16384
IMAGE_END_TOKEN_ID = NUM_VISION_TOKENS + 1  # real checkpoint: 16385
IMAGE_START_TOKEN = f"<|dit_token_{IMAGE_START_TOKEN_ID}|>"
IMAGE_END_TOKEN = f"<|dit_token_{IMAGE_END_TOKEN_ID}|>"
IMAGE_TOKEN = "<|image|>"
GRID_BOS_TOKEN = "<sop>"
GRID_EOS_TOKEN = "<eop>"
PAD_TOKEN = "<|endoftext|>"

# Sampling settings of the real checkpoint's generation_config as a third-party port reports them.
# The pipeline passes only do_sample=True, so these shape the AR policy, and log-prob recomputation
# has to apply the same temperature and top-p.
AR_TEMPERATURE = 0.9
AR_TOP_P = 0.75

VISION_PATCH_SIZE = 8  # shared by the vision tower and the image processor
T5_D_MODEL = 32  # glyph embedding width, also the DiT's text_embed_dim
VAE_LATENT_CHANNELS = 16  # as in the real VAE

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    f"{IMAGE_START_TOKEN}{IMAGE_TOKEN}{IMAGE_END_TOKEN}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)

_COMPLETE_MARKER = ".complete"

# Weight initialisation draws from torch's global RNG; two threads building at once would interleave
# their draws and break seed determinism.
_BUILD_LOCK = threading.Lock()


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order (the ByteLevel alphabet)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    symbols, num_shifted = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + num_shifted))
            num_shifted += 1
    return symbols


def _build_ar_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer with GLM-Image's special tokens, built without any files.

    Ids: ``[0, 130)`` visual tokens ``<|dit_token_i|>`` (codebook, image-start, image-end), then the
    256 byte symbols, then ``<|image|>`` (386), ``<sop>``, ``<eop>`` and the pad token (389).
    """
    visual_tokens = [f"<|dit_token_{i}|>" for i in range(IMAGE_END_TOKEN_ID + 1)]
    text_specials = [IMAGE_TOKEN, GRID_BOS_TOKEN, GRID_EOS_TOKEN, PAD_TOKEN]
    vocab = {token: i for i, token in enumerate(visual_tokens + _byte_symbols() + text_specials)}

    # No merges: every byte is one token, which keeps the vocabulary and the AR embedding tiny.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Registered specials are matched atomically (never split into bytes) and keep their vocab ids.
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in visual_tokens + text_specials]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IMAGE_START_TOKEN,
        eos_token=IMAGE_END_TOKEN,
        pad_token=PAD_TOKEN,
        # GlmImageProcessor.__init__ reads these as tokenizer attributes; named extra special tokens
        # are exposed as attributes and survive save_pretrained / from_pretrained.
        extra_special_tokens={
            "image_token": IMAGE_TOKEN,
            "grid_bos_token": GRID_BOS_TOKEN,
            "grid_eos_token": GRID_EOS_TOKEN,
        },
        # The pipeline pads prompt batches and reads generated tokens from the common input length
        # onwards, which is only right with left padding.
        padding_side="left",
    )


def _build_processor() -> GlmImageProcessor:
    image_processor = GlmImageImageProcessorPil(
        patch_size=VISION_PATCH_SIZE,
        # GlmImageVisionPatchEmbed reshapes pixels to (-1, C, patch, patch): one frame, no merging.
        temporal_patch_size=1,
        merge_size=1,
        size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128},  # pixel-count bounds, source images
    )
    return GlmImageProcessor(
        image_processor=image_processor, tokenizer=_build_ar_tokenizer(), chat_template=CHAT_TEMPLATE
    )


def _build_text_encoder() -> T5EncoderModel:
    """ByT5-style glyph encoder; its 384-entry vocabulary matches ``ByT5Tokenizer``."""
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
    vision_hidden_size = 32
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "vision_vocab_size": NUM_VISION_TOKENS,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # grouped-query attention like the real 32 / 2 heads
            "max_position_embeddings": 1024,
            # Real: head_dim 128, partial rotary 0.5, mrope_section (8, 12, 12) over 32 frequencies.
            # Here head_dim 32 leaves 8 rotary frequencies, split (t, h, w) = (2, 3, 3).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 3, 3],
            },
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": IMAGE_END_TOKEN_ID,
        },
        vision_config={
            "depth": 2,
            "hidden_size": vision_hidden_size,
            "num_heads": 2,
            "intermediate_size": 64,
            "image_size": 32,  # a 4x4 learned position grid, resampled to any patch grid
            "patch_size": VISION_PATCH_SIZE,
            "spatial_merge_size": 1,
        },
        # The VQ quantiser reads vision-tower features directly: latent_channels == vision hidden size.
        vq_config={
            "embed_dim": 32,
            "num_embeddings": NUM_VISION_TOKENS,
            "latent_channels": vision_hidden_size,
        },
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_start_token_id=IMAGE_START_TOKEN_ID,
        image_end_token_id=IMAGE_END_TOKEN_ID,
    )
    model = GlmImageForConditionalGeneration(config)
    generation_config = model.generation_config
    generation_config.pad_token_id = tokenizer.pad_token_id
    generation_config.bos_token_id = IMAGE_START_TOKEN_ID
    generation_config.eos_token_id = IMAGE_END_TOKEN_ID
    generation_config.do_sample = True
    generation_config.temperature = AR_TEMPERATURE
    generation_config.top_p = AR_TOP_P
    return model


def _build_vae(seed: int) -> AutoencoderKL:
    # Non-trivial per-channel statistics, so a missing latent (de)normalisation shows up in tests.
    generator = torch.Generator().manual_seed(seed)
    latents_mean = 0.1 * torch.randn(VAE_LATENT_CHANNELS, generator=generator)
    latents_std = 0.5 + torch.rand(VAE_LATENT_CHANNELS, generator=generator)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        # Four levels give vae_scale_factor 8; with DiT patch 2 that is the d16 grid which the
        # 2x-upsampled d32 AR tokens cover.
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        norm_num_groups=4,
        latent_channels=VAE_LATENT_CHANNELS,
        sample_size=32,
        latents_mean=[round(x, 6) for x in latents_mean.tolist()],
        latents_std=[round(x, 6) for x in latents_std.tolist()],
    )


# In the real GLM-Image the AR model's prior tokens carry the image's content and the DiT renders them.
# A randomly initialised DiT barely listens to them: the JPEG size of its images moves ~3x more with the
# noise than with the tokens, which leaves the AR trainer nothing to learn. Scaling the prior-token
# embedding (its sum with the latent projection is layer-normed per token, so its share grows) and the
# output projection (so the velocity, hence the image, follows it) makes the tokens dominate: the JPEG
# reward then moves ~5x more with the tokens than with the noise (docs/benchmarks.md).
PRIOR_EMBEDDING_SCALE = 30.0
VELOCITY_SCALE = 10.0


def _build_transformer() -> GlmImageTransformer2DModel:
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=VAE_LATENT_CHANNELS,
        out_channels=VAE_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=T5_D_MODEL,
        time_embed_dim=16,
        condition_dim=8,
        prior_vq_quantizer_codebook_size=NUM_VISION_TOKENS,
    )
    with torch.no_grad():
        transformer.prior_token_embedding.weight.mul_(PRIOR_EMBEDDING_SCALE)
        for param in transformer.proj_out.parameters():
            param.mul_(VELOCITY_SCALE)
    return transformer


def _build_scheduler() -> FlowMatchEulerDiscreteScheduler:
    # The pipeline computes mu = sqrt(seq_len / 256) * 0.75 + 0.25 itself; the "linear" shift applies
    # it as sigma' = mu / (mu + (1 / sigma - 1)), the shift that ports of GLM-Image reproduce.
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
    """Build the tiny pipeline in fp32 on CPU; the same ``seed`` gives the same weights.

    The caller's global torch RNG state is left untouched.
    """

    # One derived seed per component, so that resizing one component leaves the others' weights alone.
    # Only the CPU generator is reseeded (torch.manual_seed would also reseed CUDA, which fork_rng
    # below does not restore); the weights are created on the CPU.
    def seed_component(index: int) -> int:
        component_seed = seed * 1000 + index
        torch.default_generator.manual_seed(component_seed)
        return component_seed

    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        processor = _build_processor()
        seed_component(1)
        text_encoder = _build_text_encoder()
        seed_component(2)
        vision_language_encoder = _build_vision_language_encoder(processor.tokenizer)
        vae = _build_vae(seed_component(3))
        seed_component(4)
        transformer = _build_transformer()

    return assemble_pipeline(processor, text_encoder, vision_language_encoder, vae, transformer)


def assemble_pipeline(processor, text_encoder, vision_language_encoder, vae, transformer) -> GlmImagePipeline:
    """The seven-component pipeline around built weight-holding components (in eval mode), with the
    ByT5 glyph tokenizer and GLM-Image's scheduler."""
    for module in (text_encoder, vision_language_encoder, vae, transformer):
        module.eval()
    return GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=vision_language_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=_build_scheduler(),
    )


def save_tiny_pipeline(path: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Build the tiny pipeline and ``save_pretrained`` it (safetensors) into ``path``."""
    path = pathlib.Path(path)
    build_tiny_pipeline(seed).save_pretrained(path, safe_serialization=True)
    return path


def default_cache_dir() -> pathlib.Path:
    """``$GLM_TRAINING_CACHE`` if set, else ``~/.cache/glm_training``."""
    env = os.environ.get("GLM_TRAINING_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "glm_training"


_WEIGHT_COMPONENTS = ("text_encoder", "vision_language_encoder", "vae", "transformer")


def _is_complete(folder: pathlib.Path) -> bool:
    return (folder / "model_index.json").is_file() and (folder / _COMPLETE_MARKER).is_file()


def _check_weights_written(folder: pathlib.Path) -> None:
    """Every weight-holding component must have its safetensors file before the folder is published.

    transformers' `save_pretrained` silently writes nothing on ranks other than 0 once torch.distributed is
    initialised; such a copy must never be marked complete.
    """
    empty = [c for c in _WEIGHT_COMPONENTS if not any((folder / c).glob("*.safetensors"))]
    if empty:
        raise RuntimeError(
            f"building a GLM-Image fixture wrote no weights for {empty} (transformers saves only on global "
            "rank 0 under torch.distributed). Build it on rank 0 first (the trainers do), or put "
            "$GLM_TRAINING_CACHE on a file system every node shares."
        )


def _build_into_place(
    target: pathlib.Path, save: Callable[[pathlib.Path], object], marker: dict, what: str = "tiny pipeline"
) -> None:
    """Build into a private sibling folder with ``save(folder)``, then rename it to ``target`` atomically.

    If another process renamed its copy into place first, this copy is discarded. ``marker`` is written into
    the completion marker (version, seed, sizes), last, so a folder with the marker is complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
    try:
        save(staging)
        _check_weights_written(staging)
        # Written last: a folder with the marker is complete however the writer ended.
        (staging / _COMPLETE_MARKER).write_text(json.dumps(marker))
        if target.exists() and not _is_complete(target):
            # Only a copy made outside this function can be incomplete: ours carry the marker
            # before the rename.
            logger.warning("Replacing incomplete %s folder %s", what, target)
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # Renaming onto an existing non-empty folder fails: another process won the race.
            if not _is_complete(target):
                raise
            logger.info("Another process built %s first; discarding this copy", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_built(
    target: pathlib.Path, save: Callable[[pathlib.Path], object], marker: dict, what: str
) -> pathlib.Path:
    """Return ``target``, building it with ``save(folder)`` first if it is not complete.

    Safe when several processes (e.g. torchrun ranks) call it at once: each builds into a private folder and
    the first atomic rename wins.
    """
    if not _is_complete(target):
        logger.info("Building %s into %s", what, target)
        _build_into_place(target, save, marker, what)
    return target


def ensure_tiny_pipeline(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> pathlib.Path:
    """Return ``<cache_dir>/tiny-glm-image-v{TINY_MODEL_VERSION}-seed{seed}``, building it if missing.

    Safe when several processes (e.g. torchrun ranks) call it at once. ``cache_dir`` defaults to
    :func:`default_cache_dir`.
    """
    cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"tiny-glm-image-v{TINY_MODEL_VERSION}-seed{seed}"
    return ensure_built(
        target,
        lambda folder: save_tiny_pipeline(folder, seed),
        {"version": TINY_MODEL_VERSION, "seed": seed},
        f"tiny GLM-Image pipeline (seed {seed})",
    )

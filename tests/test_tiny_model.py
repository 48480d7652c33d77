"""Tests for the tiny offline GLM-Image pipeline (glm_training.models.tiny)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pathlib

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.models.tiny import (
    IMAGE_END_TOKEN_ID,
    IMAGE_START_TOKEN_ID,
    NUM_VISION_TOKENS,
    TINY_MODEL_VERSION,
    _build_into_place,
    build_tiny_pipeline,
    ensure_tiny_pipeline,
    save_tiny_pipeline,
)

PROMPT = "a red square with the text 'HI'"


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Run on one intra-op thread: with two threads, every tiny op waits at an OpenMP barrier, and
    when other processes share the cores those waits turn milliseconds into seconds."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def reloaded_pipe(tmp_path_factory: pytest.TempPathFactory) -> GlmImagePipeline:
    """The tiny pipeline after a save_pretrained / from_pretrained round trip."""
    path = save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe")
    pipe = GlmImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(
    pipe: GlmImagePipeline, prompt: str | list[str], height: int, width: int
) -> list[PIL.Image.Image]:
    return pipe(
        prompt=prompt,
        height=height,
        width=width,
        num_inference_steps=2,
        guidance_scale=1.5,
        generator=torch.Generator().manual_seed(0),
    ).images


@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 64), (32, 64)])
def test_reloaded_pipeline_generates_image(reloaded_pipe: GlmImagePipeline, height: int, width: int) -> None:
    (image,) = _generate(reloaded_pipe, PROMPT, height, width)
    assert isinstance(image, PIL.Image.Image)
    assert image.size == (width, height)  # PIL sizes are (width, height)
    pixels = np.asarray(image)
    assert pixels.min() != pixels.max()


def test_reloaded_pipeline_generates_batch(reloaded_pipe: GlmImagePipeline) -> None:
    # Prompts of different lengths exercise left padding in the AR prompt batch.
    images = _generate(reloaded_pipe, [PROMPT, "blue"], 32, 32)
    assert [image.size for image in images] == [(32, 32), (32, 32)]


def test_ar_generate_fills_every_grid_position(reloaded_pipe: GlmImagePipeline) -> None:
    """generate() runs for exactly max_new_tokens steps and yields only codebook ids.

    The pipeline slices the large grid out of the output at a fixed offset, so an early image-end
    token or an id outside the DiT's prior vocabulary would break it.
    """
    messages = [[{"role": "user", "content": [{"type": "text", "text": p}]}] for p in [PROMPT, "blue"]]
    inputs = reloaded_pipe.processor.apply_chat_template(
        messages, tokenize=True, padding=True, target_h=64, target_w=64, return_dict=True, return_tensors="pt"
    )
    # Per sample: the 2x2 large grid first, then the 16x16 preview grid, which is generated first.
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 16, 16]] * 2
    max_new_tokens = 2 * 2 + 16 * 16 + 1
    torch.manual_seed(0)
    sequences = reloaded_pipe.vision_language_encoder.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=True
    )
    generated = sequences[:, inputs["input_ids"].shape[1] :]
    assert generated.shape == (2, max_new_tokens)
    assert int(generated.max()) < NUM_VISION_TOKENS


def test_chat_template_matches_processor_layout(reloaded_pipe: GlmImagePipeline) -> None:
    processor = reloaded_pipe.processor
    messages = [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]]
    inputs = processor.apply_chat_template(
        messages, tokenize=True, target_h=32, target_w=32, return_dict=True, return_tensors="pt"
    )
    tokens = processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())
    # Prompt bytes, the large 1x1 grid hint, the 16x16 preview grid hint, then image-start.
    prompt, large_grid, preview_grid = ["h", "i"], ["1", "Ġ", "1"], ["1", "6", "Ġ", "1", "6"]
    image_start = f"<|dit_token_{IMAGE_START_TOKEN_ID}|>"
    assert tokens == [*prompt, "<sop>", *large_grid, "<eop>", "<sop>", *preview_grid, "<eop>", image_start]
    assert inputs["image_grid_thw"].tolist() == [[1, 1, 1], [1, 16, 16]]
    assert inputs["images_per_sample"].tolist() == [2]


def test_reloaded_tokenizer_carries_special_tokens(reloaded_pipe: GlmImagePipeline) -> None:
    tokenizer = reloaded_pipe.processor.tokenizer
    config = reloaded_pipe.vision_language_encoder.config
    assert tokenizer.image_token == "<|image|>"
    assert tokenizer.grid_bos_token == "<sop>"
    assert tokenizer.grid_eos_token == "<eop>"
    assert tokenizer.bos_token_id == config.image_start_token_id == IMAGE_START_TOKEN_ID
    assert tokenizer.eos_token_id == config.image_end_token_id == IMAGE_END_TOKEN_ID
    assert tokenizer.convert_tokens_to_ids(tokenizer.image_token) == config.image_token_id
    assert tokenizer.padding_side == "left"
    assert reloaded_pipe.vision_language_encoder.generation_config.pad_token_id == tokenizer.pad_token_id


def _state_dicts(pipe: GlmImagePipeline) -> dict[str, torch.Tensor]:
    modules = {
        "text_encoder": pipe.text_encoder,
        "vision_language_encoder": pipe.vision_language_encoder,
        "vae": pipe.vae,
        "transformer": pipe.transformer,
    }
    return {
        f"{name}.{key}": value
        for name, module in modules.items()
        for key, value in module.state_dict().items()
    }


def test_build_is_deterministic_per_seed() -> None:
    rng_state = torch.get_rng_state()
    first, again, other = (_state_dicts(build_tiny_pipeline(seed)) for seed in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_state), "building must not consume the global RNG"
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_ensure_builds_once(tmp_path: pathlib.Path) -> None:
    folder = ensure_tiny_pipeline(tmp_path, seed=0)
    assert folder == tmp_path / f"tiny-glm-image-v{TINY_MODEL_VERSION}-seed0"
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns

    assert ensure_tiny_pipeline(tmp_path, seed=0) == folder
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no staging folders left behind


def test_losing_the_build_race_keeps_the_winner(tmp_path: pathlib.Path) -> None:
    from glm_training.models import tiny

    folder = ensure_tiny_pipeline(tmp_path, seed=0)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns

    # A second rank that saw no folder builds its own copy; its rename fails and the copy is dropped.
    _build_into_place(folder, lambda staging: tiny.save_tiny_pipeline(staging, 0), {"seed": 0})

    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_a_copy_without_weights_is_never_published(tmp_path):
    # What transformers leaves on a rank other than 0 under torch.distributed: configs but no weights.
    from glm_training.models import tiny

    folder = tiny.save_tiny_pipeline(tmp_path / "copy")
    for weights in (folder / "vision_language_encoder").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(RuntimeError, match="vision_language_encoder"):
        tiny._check_weights_written(folder)

"""CLIP-based rewards (pickscore, clip_score, aesthetic) on a tiny random CLIP saved locally.

Every reward is built through `build_reward` and loads the tiny CLIP with `from_pretrained` from real
files; scores are checked against independent computations with the `CLIPModel` itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from tiny_reward_models import save_tiny_clip
from transformers import CLIPModel, CLIPProcessor

import glm_training.rewards.aesthetic
import glm_training.rewards.clip_score
import glm_training.rewards.pickscore  # noqa: F401  (imported to register the rewards)
from glm_training.errors import UserError
from glm_training.rewards.clip_base import ClipEmbedder
from glm_training.rewards.registry import build_reward

PROJECTION_DIM = 16
PROMPTS = ["the cat", "a dog on the grass", "the cat", "do cats dream?"]  # one repeat, as in GRPO groups


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"), projection_dim=PROJECTION_DIM)


@pytest.fixture(scope="module")
def clip_reference(clip_dir):
    """The saved model and processor, loaded independently of the rewards."""
    return CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir, backend="pil")


def make_images() -> list[Image.Image]:
    """Four images of different sizes and modes (RGB, L, RGBA), so resize, crop and RGB conversion all act."""
    generator = torch.Generator().manual_seed(1)
    noise = (torch.rand(48, 40, 3, generator=generator) * 255).to(torch.uint8).numpy()
    return [
        Image.fromarray(noise),
        Image.new("L", (32, 64), 200),
        Image.new("RGBA", (70, 50), (20, 160, 90, 255)),
        Image.fromarray(noise[::-1, :, ::-1].copy()).resize((33, 33)),
    ]


def reference_cosines(clip_reference, images, prompts) -> torch.Tensor:
    """cos(image_i, prompt_i) from `CLIPModel.forward`'s own logits: diag(logits_per_image) / exp(scale)."""
    model, processor = clip_reference
    inputs = processor(text=prompts, images=images, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits_per_image = model(**inputs).logits_per_image
    return logits_per_image.diagonal() / model.logit_scale.exp()


def save_tiny_head(path, widths=(PROJECTION_DIM, 32, 8, 8, 4), seed=0) -> dict[str, torch.Tensor]:
    """A random head in the original state-dict format (`layers.{0,2,4,6,7}`), saved by file suffix."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [*widths, 1]
    state_dict = {}
    for index, (w_in, w_out) in zip((0, 2, 4, 6, 7), zip(sizes[:-1], sizes[1:])):
        state_dict[f"layers.{index}.weight"] = torch.randn(w_out, w_in, generator=generator) / math.sqrt(w_in)
        state_dict[f"layers.{index}.bias"] = torch.randn(w_out, generator=generator)
    if str(path).endswith(".safetensors"):
        save_file(state_dict, str(path))
    else:
        torch.save(state_dict, path)
    return state_dict


def build(name: str, clip_dir, tmp_path=None, **options):
    if name == "pickscore":
        return build_reward(name, model=str(clip_dir), processor=str(clip_dir), device="cpu", **options)
    if name == "clip_score":
        return build_reward(name, model=str(clip_dir), device="cpu", **options)
    head = tmp_path / "head.pth"
    if not head.exists():
        save_tiny_head(head)
    return build_reward(name, clip_model=str(clip_dir), head=str(head), device="cpu", **options)


def test_pickscore_matches_clip_logits(clip_dir, clip_reference):
    images = make_images()
    scores = build("pickscore", clip_dir)(images, PROMPTS, [{}] * 4)
    model, _ = clip_reference
    expected = reference_cosines(clip_reference, images, PROMPTS) * model.logit_scale.exp()
    assert scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.shape == (4,)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # Distinct images score differently: the embedding depends on the pixels.
    assert (scores[0] - scores[2]).abs() > 1e-3

    scaled = build("pickscore", clip_dir, scale=26.0)(images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(scaled, expected / 26.0, rtol=1e-5, atol=1e-6)


def test_clip_score_is_clamped_scaled_cosine(clip_dir, clip_reference):
    images = make_images()
    prompts = ["a dog on the grass", "the cat", "xyz 123", "do cats dream?"]
    cosine = reference_cosines(clip_reference, images, prompts)
    # The tiny model gives both signs here, so the clamp at 0 is exercised (fixed seed: deterministic).
    assert (cosine < 0).any() and (cosine > 0).any(), cosine
    scores = build("clip_score", clip_dir)(images, prompts, [{}] * 4)
    torch.testing.assert_close(scores, 2.5 * cosine.clamp(min=0), rtol=1e-5, atol=1e-6)

    prefixed = build("clip_score", clip_dir, w=1.0, prefix="A photo depicts ")(images, prompts, [{}] * 4)
    expected = reference_cosines(clip_reference, images, ["A photo depicts " + p for p in prompts])
    torch.testing.assert_close(prefixed, expected.clamp(min=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_aesthetic_matches_head_by_hand(clip_dir, clip_reference, tmp_path, suffix):
    state_dict = save_tiny_head(tmp_path / f"head{suffix}")
    images = make_images()
    reward = build_reward("aesthetic", clip_model=str(clip_dir), head=str(tmp_path / f"head{suffix}"))
    scores = reward(images, PROMPTS, [{}] * 4)

    model, processor = clip_reference
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        embeds = model.get_image_features(pixel_values=pixels).pooler_output
    hidden = embeds / embeds.norm(dim=-1, keepdim=True)
    # Five affine maps, no activations; dropout is off at inference.
    for index in (0, 2, 4, 6, 7):
        hidden = hidden @ state_dict[f"layers.{index}.weight"].T + state_dict[f"layers.{index}.bias"]
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    torch.testing.assert_close(scores, hidden[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "aesthetic"])
def test_batching_does_not_change_scores(clip_dir, tmp_path, name):
    images = make_images()
    one = build(name, clip_dir, tmp_path, batch_size=1)(images, PROMPTS, [{}] * 4)
    four = build(name, clip_dir, tmp_path, batch_size=4)(images, PROMPTS, [{}] * 4)
    three = build(name, clip_dir, tmp_path, batch_size=3)(images, PROMPTS, [{}] * 4)  # a ragged last batch
    torch.testing.assert_close(one, four, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(three, four, rtol=1e-5, atol=1e-6)
    # Scoring a pair alone gives its score in the batch.
    alone = build(name, clip_dir, tmp_path)(images[3:], PROMPTS[3:], [{}])
    torch.testing.assert_close(alone, four[3:], rtol=1e-5, atol=1e-6)


def test_preprocessing_golden(clip_dir):
    """Resize (short side 64 -> 32), centre crop 32 of 64 columns, rescale, CLIP mean/std."""
    # 128x64 (w x h): left half red, right half blue. Resized to 64x32, the colour edge is at column
    # 32; the centre crop keeps columns 16..47, so the edge lands at crop column 16. Bicubic blends
    # only within ~2 output pixels of the edge, so columns <= 13 are pure red and >= 19 pure blue.
    image = Image.new("RGB", (128, 64), (255, 0, 0))
    image.paste((0, 0, 255), (64, 0, 128, 64))
    pixels = ClipEmbedder(str(clip_dir), device="cpu").pixel_values([image])
    assert pixels.shape == (1, 3, 32, 32)
    mean = (0.48145466, 0.4578275, 0.40821073)
    std = (0.26862954, 0.26130258, 0.27577711)
    # red (1, 0, 0): ((1 - 0.48145466) / 0.26862954, -0.4578275 / 0.26130258, -0.40821073 / 0.27577711)
    #              = (1.930336, -1.752100, -1.480216)
    red = torch.tensor([(1.0 - mean[0]) / std[0], -mean[1] / std[1], -mean[2] / std[2]])
    blue = torch.tensor([-mean[0] / std[0], -mean[1] / std[1], (1.0 - mean[2]) / std[2]])
    torch.testing.assert_close(red, torch.tensor([1.930336, -1.752100, -1.480216]), atol=1e-5, rtol=0)
    for row, col in [(0, 0), (31, 5), (10, 13)]:
        torch.testing.assert_close(pixels[0, :, row, col], red, atol=1e-5, rtol=0)
    for row, col in [(0, 31), (20, 19), (31, 25)]:
        torch.testing.assert_close(pixels[0, :, row, col], blue, atol=1e-5, rtol=0)
    # The edge itself is a blend, so the crop offset is pinned to the column.
    assert -1.9 < pixels[0, 0, 5, 16] < 1.9


def test_long_prompts_are_truncated_to_77_tokens(clip_dir):
    reward = build("pickscore", clip_dir)
    image = make_images()[:1]
    # The tiny tokenizer makes "the" and "cat" one token each: 75 text tokens + BOS + EOS = 77.
    long = reward(image, ["the cat " * 100], [{}])
    truncated = reward(image, ["the cat " * 37 + "the"], [{}])
    shorter = reward(image, ["the cat " * 37], [{}])
    torch.testing.assert_close(long, truncated, rtol=1e-5, atol=1e-6)
    assert (long - shorter).abs() > 1e-6  # the 75th token mattered: truncation happened after it


def test_head_clip_width_mismatch_names_both(clip_dir, tmp_path):
    save_tiny_head(tmp_path / "head8.pth", widths=(8, 32, 8, 8, 4))
    with pytest.raises(ValueError, match=r"takes 8-dim embeddings.*embeds images into 16 dims"):
        build_reward("aesthetic", clip_model=str(clip_dir), head=str(tmp_path / "head8.pth"), device="cpu")


def test_bad_head_files(clip_dir, tmp_path):
    torch.save({"weight": torch.zeros(1, 16)}, tmp_path / "linear.pth")
    with pytest.raises(ValueError, match="not an improved-aesthetic-predictor state dict"):
        build_reward("aesthetic", clip_model=str(clip_dir), head=str(tmp_path / "linear.pth"))
    with pytest.raises(FileNotFoundError, match="missing.pth' does not exist"):
        build_reward("aesthetic", clip_model=str(clip_dir), head=str(tmp_path / "missing.pth"))
    with pytest.raises(FileNotFoundError, match="not an existing file, nor of the hub form"):
        build_reward("aesthetic", clip_model=str(clip_dir), head="head.pth")
    # A hub file that is not in the (offline) cache: the error says how to get it, and is a user error (the
    # entry points print it as one message and exit 2).
    with pytest.raises(FileNotFoundError, match="hf download nobody/none-such head.pth") as err:
        build_reward("aesthetic", clip_model=str(clip_dir), head="nobody/none-such/head.pth")
    assert isinstance(err.value, UserError)


def test_head_from_hub_cache(clip_dir, tmp_path, monkeypatch):
    """ "owner/repo/file" resolves through the real offline hub cache (a snapshot laid out by hand)."""
    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--laion--tiny-aesthetic"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    save_tiny_head(repo / "snapshots" / commit / "sac+logos.pth", seed=3)
    save_tiny_head(tmp_path / "local.pth", seed=3)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    images = make_images()
    hub = build_reward("aesthetic", clip_model=str(clip_dir), head="laion/tiny-aesthetic/sac+logos.pth")
    local = build_reward("aesthetic", clip_model=str(clip_dir), head=str(tmp_path / "local.pth"))
    torch.testing.assert_close(hub(images, PROMPTS, [{}] * 4), local(images, PROMPTS, [{}] * 4))


@pytest.mark.parametrize("device", ["gpu", "cuda:0"])
def test_bad_device_is_rejected(clip_dir, device):
    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("cuda:0 is a valid device here")
    with pytest.raises(ValueError, match="reward device"):
        build_reward("pickscore", model=str(clip_dir), processor=str(clip_dir), device=device)


def test_bad_options_and_inputs(clip_dir):
    with pytest.raises(ValueError, match="scale must be a positive number"):
        build("pickscore", clip_dir, scale=0.0)
    with pytest.raises(ValueError, match="w must be a positive number"):
        build("clip_score", clip_dir, w=-1.0)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        build("clip_score", clip_dir, batch_size=0)
    with pytest.raises(OSError, match="could not load the CLIP model"):
        build_reward("clip_score", model=str(clip_dir / "nowhere"), device="cpu")
    reward = build("clip_score", clip_dir)
    with pytest.raises(ValueError, match="2 images and 1 prompts"):
        reward(make_images()[:2], ["the cat"], [{}, {}])
    assert reward([], [], []).shape == (0,)


def test_bfloat16_weights_give_float32_scores_close_to_float32(clip_dir):
    images = make_images()
    full = build("pickscore", clip_dir)(images, PROMPTS, [{}] * 4)
    half = build("pickscore", clip_dir, dtype="bfloat16")(images, PROMPTS, [{}] * 4)
    assert half.dtype == torch.float32
    # bf16 keeps ~3 significant digits through two tiny 2-layer towers; scores are ~|14| at most.
    torch.testing.assert_close(half, full, rtol=0, atol=0.3)
    # The temperature is read before the cast: bf16 would round log(1 / 0.07) = 2.6593 to 2.6562.
    from transformers import CLIPModel

    from glm_training.rewards.clip_base import ClipEmbedder

    exact = CLIPModel.from_pretrained(clip_dir).logit_scale.item()
    assert ClipEmbedder(str(clip_dir), dtype="bfloat16", device="cpu").logit_scale == exact
    assert torch.tensor(exact).bfloat16().item() != exact  # the check above can fail

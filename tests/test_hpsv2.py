"""HPSv2 reward: open_clip <-> transformers conversion, HPSv2's preprocessing, the scorer end to end.

A tiny random CLIP stands in for ViT-H-14. Its weights are written in open_clip's layout and file format
(`{"state_dict": {"module.<key>": tensor}}` in a .pt file) and loaded through the real scorer path. The
reference for the conversion is an independent re-implementation of open_clip's forward pass over the
open_clip tensors (fused-qkv `F.multi_head_attention_forward`, sequence-first, `x @ proj`), not the
inverse conversion.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tiny_reward_models import save_tiny_clip
from transformers import AutoTokenizer, BertTokenizer, CLIPModel

from glm_training.rewards import build_reward
from glm_training.rewards.hpsv2 import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    hpsv2_pixel_values,
    resolve_checkpoint,
)
from glm_training.rewards.open_clip_convert import (
    OPEN_CLIP_ARCHS,
    clip_config,
    expected_shapes,
    load_open_clip_into_transformers,
    open_clip_to_transformers,
    transformers_to_open_clip,
    unwrap_open_clip_checkpoint,
)

WIDTH, HEADS, LAYERS, EMBED, IMAGE, PATCH = 32, 2, 2, 16, 32, 8
PROMPTS = ["the cat", "a dog on the grass", "the cat"]


def tiny_arch(tokenizer) -> dict:
    """CLIPConfig kwargs of a tiny open_clip-like ViT CLIP (exact GELU, eps 1e-5) for `tokenizer`."""
    vocab = tokenizer.get_vocab()
    common = {
        "hidden_size": WIDTH,
        "intermediate_size": 4 * WIDTH,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
    }
    text = {
        **common,
        "vocab_size": max(vocab.values()) + 1,
        "max_position_embeddings": 77,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    vision = {**common, "image_size": IMAGE, "patch_size": PATCH}
    return {"projection_dim": EMBED, "text_config": text, "vision_config": vision}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def arch(tokenizer) -> dict:
    return tiny_arch(tokenizer)


@pytest.fixture(scope="module")
def hf_state_dict(arch) -> dict[str, torch.Tensor]:
    """A tiny CLIPModel with every tensor random (no zero bias or unit LayerNorm hides a wrong mapping)."""
    torch.manual_seed(0)
    model = CLIPModel(clip_config(arch))
    state_dict = {}
    for name, tensor in model.state_dict().items():
        noise = 0.2 * torch.randn_like(tensor)
        state_dict[name] = noise + 1.0 if "norm" in name and name.endswith("weight") else noise
    return state_dict


@pytest.fixture(scope="module")
def open_clip_sd(hf_state_dict, arch) -> dict[str, torch.Tensor]:
    return transformers_to_open_clip(hf_state_dict, clip_config(arch))


@pytest.fixture(scope="module")
def checkpoint_file(open_clip_sd, tmp_path_factory) -> Path:
    """The tiny weights saved like an open_clip training checkpoint of a DDP model."""
    path = tmp_path_factory.mktemp("hps") / "HPS_tiny.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in open_clip_sd.items()}}, path)
    return path


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    sizes = [(48, 20), (17, 40), (32, 32)]  # (width, height): wide, tall, square at the model size
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


# --------------------------------------------------------------------------- independent open_clip forward


def _layer_norm(x: torch.Tensor, sd: dict, prefix: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[f"{prefix}.weight"], sd[f"{prefix}.bias"], eps=1e-5)


def _open_clip_transformer(x_lnd: torch.Tensor, sd: dict, prefix: str, mask=None) -> torch.Tensor:
    """open_clip's ResidualAttentionBlock stack: x + attn(ln_1 x), x + c_proj(gelu(c_fc(ln_2 x))), LND."""
    for index in range(LAYERS):
        p = f"{prefix}.resblocks.{index}"
        h = _layer_norm(x_lnd, sd, f"{p}.ln_1")
        attn, _ = F.multi_head_attention_forward(
            h, h, h, WIDTH, HEADS,
            sd[f"{p}.attn.in_proj_weight"], sd[f"{p}.attn.in_proj_bias"],
            None, None, False, 0.0,
            sd[f"{p}.attn.out_proj.weight"], sd[f"{p}.attn.out_proj.bias"],
            training=False, need_weights=False, attn_mask=mask,
        )  # fmt: skip
        x_lnd = x_lnd + attn
        h = _layer_norm(x_lnd, sd, f"{p}.ln_2")
        h = F.linear(F.gelu(F.linear(h, sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"])),
                     sd[f"{p}.mlp.c_proj.weight"], sd[f"{p}.mlp.c_proj.bias"])  # fmt: skip
        x_lnd = x_lnd + h
    return x_lnd


def open_clip_encode_image(sd: dict, pixels_nchw: torch.Tensor) -> torch.Tensor:
    x = F.conv2d(pixels_nchw, sd["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + sd["visual.positional_embedding"]
    x = _layer_norm(x, sd, "visual.ln_pre")
    x = _open_clip_transformer(x.transpose(0, 1), sd, "visual.transformer").transpose(0, 1)
    return _layer_norm(x[:, 0], sd, "visual.ln_post") @ sd["visual.proj"]


def open_clip_encode_text(sd: dict, ids_nl: torch.Tensor) -> torch.Tensor:
    length = ids_nl.shape[1]
    x = sd["token_embedding.weight"][ids_nl] + sd["positional_embedding"][:length]
    causal = torch.full((length, length), float("-inf")).triu(1)
    x = _open_clip_transformer(x.transpose(0, 1), sd, "transformer", causal).transpose(0, 1)
    x = _layer_norm(x, sd, "ln_final")
    return x[torch.arange(x.shape[0]), ids_nl.argmax(dim=-1)] @ sd["text_projection"]


def open_clip_ids(tokenizer, texts: list[str]) -> torch.Tensor:
    """open_clip's tokenisation: SOT, tokens, EOT, then zeros (open_clip pads with id 0) to 77."""
    ids = tokenizer(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    ids = ids["input_ids"].clone()
    for row in ids:
        eot = int(row.eq(tokenizer.eos_token_id).nonzero()[0])
        row[eot + 1 :] = 0
    return ids


def golden_pixel_values(image: Image.Image, size: int) -> torch.Tensor:
    """HPSv2's transform with PIL: per-channel float ("F") bicubic resize, which PIL antialiases exactly as
    `interpolate(antialias=True)` does; numpy zero padding; normalisation."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    h, w = rgb.shape[:2]
    nh, nw = round(h * size / max(h, w)), round(w * size / max(h, w))
    channels = [
        np.asarray(Image.fromarray(rgb[:, :, c], mode="F").resize((nw, nh), Image.Resampling.BICUBIC))
        for c in range(3)
    ]
    top, left = (size - nh) // 2, (size - nw) // 2
    out = np.zeros((3, size, size), dtype=np.float32)
    out[:, top : top + nh, left : left + nw] = np.stack(channels)
    mean, std = np.array(OPENAI_CLIP_MEAN)[:, None, None], np.array(OPENAI_CLIP_STD)[:, None, None]
    return torch.from_numpy(((out - mean) / std).astype(np.float32))


# --------------------------------------------------------------------------- conversion


def test_vit_h_14_arch_sizes():
    config = clip_config("ViT-H-14")
    vision, text = config.vision_config, config.text_config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (1280, 32, 16)
    assert (vision.patch_size, vision.image_size, vision.intermediate_size) == (14, 224, 4 * 1280)
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (1024, 24, 16)
    assert (text.max_position_embeddings, text.vocab_size, config.projection_dim) == (77, 49408, 1024)
    assert vision.hidden_act == text.hidden_act == "gelu"
    assert vision.layer_norm_eps == text.layer_norm_eps == 1e-5
    shapes = expected_shapes(config)
    # 224 / 14 = 16 -> 256 patches + class token; MLP 4 * 1280 = 5120.
    assert shapes["vision_model.embeddings.position_embedding.weight"] == (257, 1280)
    assert shapes["vision_model.encoder.layers.31.mlp.fc1.weight"] == (5120, 1280)
    assert shapes["visual_projection.weight"] == (1024, 1280)
    assert set(OPEN_CLIP_ARCHS) == {"ViT-H-14"}

    # The full-size open_clip layout, on weightless (meta) tensors: per block ln_1, in_proj, out_proj,
    # ln_2, c_fc, c_proj (weight + bias each) = 12 keys; vision 8 + 32 * 12, text 5 + 24 * 12, logit_scale.
    with torch.device("meta"):
        hf_meta = CLIPModel(config).state_dict()
    open_clip_meta = transformers_to_open_clip(hf_meta, config)
    assert len(open_clip_meta) == 8 + 32 * 12 + 5 + 24 * 12 + 1 == 686
    assert open_clip_meta["visual.conv1.weight"].shape == (1280, 3, 14, 14)
    assert open_clip_meta["visual.class_embedding"].shape == (1280,)
    assert open_clip_meta["visual.proj"].shape == (1280, 1024)
    assert open_clip_meta["visual.transformer.resblocks.31.attn.in_proj_weight"].shape == (3840, 1280)
    assert open_clip_meta["token_embedding.weight"].shape == (49408, 1024)
    assert open_clip_meta["positional_embedding"].shape == (77, 1024)
    assert open_clip_meta["transformer.resblocks.23.mlp.c_fc.weight"].shape == (4096, 1024)
    assert open_clip_meta["text_projection"].shape == (1024, 1024)
    assert open_clip_to_transformers(open_clip_meta, config).keys() == hf_meta.keys()


def test_open_clip_layout_and_round_trip(hf_state_dict, open_clip_sd, arch):
    config = clip_config(arch)
    # open_clip's layouts: fused q/k/v rows, projections [width, embed] applied as x @ proj.
    assert open_clip_sd["visual.proj"].shape == (WIDTH, EMBED)
    assert open_clip_sd["text_projection"].shape == (WIDTH, EMBED)
    assert open_clip_sd["visual.transformer.resblocks.1.attn.in_proj_weight"].shape == (3 * WIDTH, WIDTH)
    assert open_clip_sd["transformer.resblocks.0.attn.in_proj_bias"].shape == (3 * WIDTH,)
    assert open_clip_sd["visual.positional_embedding"].shape == ((IMAGE // PATCH) ** 2 + 1, WIDTH)
    k_rows = open_clip_sd["transformer.resblocks.1.attn.in_proj_weight"][WIDTH : 2 * WIDTH]
    assert torch.equal(k_rows, hf_state_dict["text_model.encoder.layers.1.self_attn.k_proj.weight"])
    # In each of the 2 * LAYERS blocks the 6 q/k/v weights and biases fuse into 2 tensors: 78 - 16 = 62.
    assert len(open_clip_sd) == len(hf_state_dict) - 4 * (2 * LAYERS) == 62

    back = open_clip_to_transformers(open_clip_sd, config)
    assert back.keys() == hf_state_dict.keys()
    for name, tensor in hf_state_dict.items():
        assert torch.equal(back[name], tensor), name


def test_converted_model_matches_independent_open_clip_forward(open_clip_sd, arch, tokenizer):
    model = load_open_clip_into_transformers(open_clip_sd, clip_config(arch))
    pixels_nchw = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.get_image_features(pixel_values=pixels_nchw).pooler_output
    reference = open_clip_encode_image(open_clip_sd, pixels_nchw)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)

    # transformers input: padded with EOT (first-EOT pooling); open_clip's: padded with 0 (argmax pooling).
    hf_ids = tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt")["input_ids"]
    oc_ids = open_clip_ids(tokenizer, PROMPTS)
    assert not torch.equal(hf_ids, oc_ids) and oc_ids[0, -1] == 0
    with torch.no_grad():
        ours = model.get_text_features(input_ids=hf_ids).pooler_output
    torch.testing.assert_close(ours, open_clip_encode_text(open_clip_sd, oc_ids), rtol=1e-5, atol=1e-5)


def test_checkpoint_wrappers_are_unwrapped(open_clip_sd):
    wrapped = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in open_clip_sd.items()}}
    assert unwrap_open_clip_checkpoint(wrapped).keys() == open_clip_sd.keys()
    assert unwrap_open_clip_checkpoint(dict(open_clip_sd)).keys() == open_clip_sd.keys()


def test_missing_and_unmapped_keys_are_listed(open_clip_sd, arch):
    broken = dict(open_clip_sd)
    del broken["visual.transformer.resblocks.1.mlp.c_fc.bias"]
    broken["visual.attn_pool.query"] = torch.zeros(1)
    with pytest.raises(ValueError, match="1 open_clip keys missing") as info:
        open_clip_to_transformers(broken, clip_config(arch))
    assert "visual.transformer.resblocks.1.mlp.c_fc.bias" in str(info.value)
    assert "no transformers counterpart: visual.attn_pool.query" in str(info.value)


def test_wrong_arch_is_reported(open_clip_sd, arch):
    deeper = {**arch, "text_config": {**arch["text_config"], "num_hidden_layers": LAYERS + 1}}
    with pytest.raises(
        ValueError, match=r"transformer\.resblocks\.2\.ln_1\.weight.*pass the matching `arch`"
    ):
        open_clip_to_transformers(open_clip_sd, clip_config(deeper))
    wider = {**arch, "projection_dim": EMBED * 2}
    with pytest.raises(ValueError, match=r"visual_projection\.weight \(16, 32\) \(config wants \(32, 32\)\)"):
        open_clip_to_transformers(open_clip_sd, clip_config(wider))
    with pytest.raises(ValueError, match="unknown open_clip architecture 'ViT-H-15'.*ViT-H-14"):
        clip_config("ViT-H-15")


# --------------------------------------------------------------------------- preprocessing


def test_preprocessing_golden_constant_images():
    red = np.array([255, 0, 128]) / 255.0
    # Red channel: (1 - 0.48145466) / 0.26862954 = 1.930336; padding: -0.48145466 / 0.26862954 = -1.792263.
    content = (red - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    pad = -np.array(OPENAI_CLIP_MEAN) / np.array(OPENAI_CLIP_STD)
    assert abs(content[0] - 1.930336) < 1e-6 and abs(pad[0] - -1.792263) < 1e-6
    # 16x6 -> scale 8/16: 8x3, pad_h 5 = 2 above + 3 below. 16x5 -> height round(2.5) = 2 (half to even),
    # pad 6 = 3 + 3. A constant image stays constant under the (normalised) bicubic kernel.
    for (width, height), rows in {(16, 6): range(2, 5), (16, 5): range(3, 5)}.items():
        image = Image.new("RGB", (width, height), (255, 0, 128))
        pixels = hpsv2_pixel_values(image, 8)
        assert pixels.shape == (3, 8, 8) and pixels.dtype == torch.float32
        for row in range(8):
            want = content if row in rows else pad
            torch.testing.assert_close(pixels[:, row, :], torch.tensor(want).float()[:, None].expand(3, 8))


@pytest.mark.parametrize("size", [(40, 24), (5, 3), (24, 40), (16, 16), (23, 9)])
def test_preprocessing_matches_pil_formulation(size):
    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    torch.testing.assert_close(
        hpsv2_pixel_values(image, 16), golden_pixel_values(image, 16), atol=2e-5, rtol=0
    )


def test_preprocessing_antialiases_downscaling():
    # torchvision >= 0.17 resizes tensors with antialias=True; on noise, a plain bicubic 40 -> 16 differs.
    pixels = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    plain = F.interpolate(torch.from_numpy(pixels / 255.0).permute(2, 0, 1)[None].float(), size=(16, 16),
                          mode="bicubic", align_corners=False)[0]  # fmt: skip
    mean, std = torch.tensor(OPENAI_CLIP_MEAN)[:, None, None], torch.tensor(OPENAI_CLIP_STD)[:, None, None]
    ours = hpsv2_pixel_values(Image.fromarray(pixels), 16)
    assert (ours - (plain - mean) / std).abs().max() > 0.5


def test_rgba_is_scored_on_rgb():
    rgba = Image.new("RGBA", (16, 16), (10, 200, 30, 0))
    torch.testing.assert_close(hpsv2_pixel_values(rgba, 8), hpsv2_pixel_values(rgba.convert("RGB"), 8))


# --------------------------------------------------------------------------- the scorer


def direct_scores(open_clip_sd, tokenizer, batch: list[Image.Image], prompts: list[str]) -> torch.Tensor:
    """HPSv2's score() on the open_clip tensors: diag(normalize(image) @ normalize(text).T)."""
    pixels = torch.stack([golden_pixel_values(image, IMAGE) for image in batch])
    image_nd = F.normalize(open_clip_encode_image(open_clip_sd, pixels), dim=-1)
    text_nd = F.normalize(open_clip_encode_text(open_clip_sd, open_clip_ids(tokenizer, prompts)), dim=-1)
    return torch.diagonal(image_nd @ text_nd.T)


def test_scorer_matches_direct_computation(checkpoint_file, open_clip_sd, tokenizer, tiny_dir, arch):
    reward = build_reward(
        "hpsv2",
        checkpoint=str(checkpoint_file),
        arch=arch,
        tokenizer=str(tiny_dir),
        device="cpu",
        batch_size=2,
    )
    batch = images()
    scores = reward(batch, PROMPTS, [{}] * 3)
    assert scores.shape == (3,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    torch.testing.assert_close(
        scores, direct_scores(open_clip_sd, tokenizer, batch, PROMPTS), atol=2e-5, rtol=0
    )
    assert float(scores.abs().max()) <= 1.0 + 1e-6 and len(set(scores.tolist())) == 3
    # Pairs are scored independently of their batch neighbours.
    torch.testing.assert_close(reward(batch[1:2], PROMPTS[1:2], [{}]), scores[1:2], atol=1e-6, rtol=0)


def test_converted_model_folder_scores_the_same(checkpoint_file, open_clip_sd, tiny_dir, arch, tmp_path):
    folder = tmp_path / "converted"
    load_open_clip_into_transformers(open_clip_sd, clip_config(arch)).save_pretrained(folder)
    from_folder = build_reward("hpsv2", model=str(folder), tokenizer=str(tiny_dir), device="cpu")
    from_checkpoint = build_reward(
        "hpsv2", checkpoint=str(checkpoint_file), arch=arch, tokenizer=str(tiny_dir), device="cpu"
    )
    batch = images()
    torch.testing.assert_close(
        from_folder(batch, PROMPTS, [{}] * 3), from_checkpoint(batch, PROMPTS, [{}] * 3)
    )


def test_half_precision_checkpoint_is_scored_in_float32(open_clip_sd, tokenizer, tiny_dir, arch, tmp_path):
    half_sd = {k: v.half() for k, v in open_clip_sd.items()}
    path = tmp_path / "half.pt"
    torch.save({"state_dict": half_sd}, path)
    reward = build_reward("hpsv2", checkpoint=str(path), arch=arch, tokenizer=str(tiny_dir), device="cpu")
    assert reward.embedder.model.logit_scale.dtype == torch.float32
    batch = images()
    want = direct_scores({k: v.float() for k, v in half_sd.items()}, tokenizer, batch, PROMPTS)
    torch.testing.assert_close(reward(batch, PROMPTS, [{}] * 3), want, atol=2e-5, rtol=0)


def test_checkpoint_with_missing_keys_fails_clearly(open_clip_sd, tiny_dir, arch, tmp_path):
    path = tmp_path / "broken.pt"
    torch.save({"state_dict": {k: v for k, v in open_clip_sd.items() if k != "ln_final.bias"}}, path)
    with pytest.raises(ValueError, match="1 open_clip keys missing from the checkpoint: ln_final.bias"):
        build_reward("hpsv2", checkpoint=str(path), arch=arch, tokenizer=str(tiny_dir), device="cpu")


def test_checkpoint_with_pickled_objects_is_refused(open_clip_sd, tiny_dir, arch, tmp_path):
    path = tmp_path / "with_args.pt"
    torch.save({"state_dict": open_clip_sd, "args": argparse.Namespace(lr=1e-5)}, path)
    with pytest.raises(
        ValueError, match="(?s)weights_only loading refuses.*argparse.Namespace.*Fix: re-save"
    ):
        build_reward("hpsv2", checkpoint=str(path), arch=arch, tokenizer=str(tiny_dir), device="cpu")


def test_exactly_one_of_checkpoint_and_model(checkpoint_file, tiny_dir):
    with pytest.raises(ValueError, match="exactly one of `checkpoint`.*and `model`"):
        build_reward("hpsv2", checkpoint=str(checkpoint_file), model=str(tiny_dir), tokenizer=str(tiny_dir))
    with pytest.raises(ValueError, match="exactly one of `checkpoint`.*and `model`.*e.g. checkpoint="):
        build_reward("hpsv2", checkpoint=None, tokenizer=str(tiny_dir))


def test_checkpoint_resolution(checkpoint_file, tmp_path):
    assert resolve_checkpoint(str(checkpoint_file)) == checkpoint_file
    with pytest.raises(FileNotFoundError, match="nor of the hub form"):
        resolve_checkpoint("missing.pt")
    with pytest.raises(FileNotFoundError, match="missing.pt' does not exist"):
        resolve_checkpoint(str(tmp_path / "missing.pt"))
    # Tests run with HF_HUB_OFFLINE=1: the hub form is tried, then fails with the download command.
    with pytest.raises(FileNotFoundError, match="hf download xswu/HPSv2 HPS_v2.1_compressed.pt"):
        resolve_checkpoint("xswu/HPSv2/HPS_v2.1_compressed.pt")


def test_tokenizer_whose_eot_is_not_the_top_id_is_rejected(checkpoint_file, arch, tmp_path):
    # A BERT-style vocabulary: [SEP] (the end token) is not the largest id, so argmax pooling breaks.
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(tmp_path / "vocab.txt"), eos_token="[SEP]").save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="end-of-text id 3 is not its largest token id"):
        build_reward("hpsv2", checkpoint=str(checkpoint_file), arch=arch, tokenizer=str(tmp_path / "bert"))

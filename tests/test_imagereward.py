"""ImageReward reward: official-layout checkpoint conversion, parity with plain-torch re-implementations of
BLIP's timm ViT and med.py BERT, the normalised MLP head, tokenisation and image preprocessing goldens.

A tiny random model is written in the official `ImageReward.pt` key layout (the module names of BLIP's
`vit.py` / `med.py` and ImageReward's `MLP`) with a `med_config.json` and a WordPiece `vocab.txt`, then
loaded through `build_reward("imagereward", model=folder, tokenizer=folder)`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from glm_training.rewards import build_reward
from glm_training.rewards.imagereward import (
    ImageRewardScorer,
    imagereward_preprocess,
    imagereward_to_transformers,
)

# Tiny sizes. Vision width 128 gives 2 heads of 64 (the head count the loader derives).
VISION_WIDTH, VISION_DEPTH, VISION_MLP, PATCH, IMAGE_SIZE = 128, 2, 256, 8, 16
TEXT_WIDTH, TEXT_DEPTH, TEXT_HEADS, TEXT_FFN, TEXT_POSITIONS = 32, 2, 2, 64, 40
HEAD_SIZES = (TEXT_WIDTH, 24, 16, 12, 8, 1)
VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "cat", "dog",
    "on", "the", "table", "photo", "of", "##s", "green", "tree",
]  # fmt: skip
VOCAB_SIZE = len(VOCAB) + 2  # + [DEC] and [ENC], as bert-base-uncased's 30522 + 2 = med_config's 30524
PROMPTS = ["a red cat", "a photo of the blue dog on the table", "green tree", "cat", "the dogs"]


def official_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the key names of ImageReward(BLIP_Pretrain(vit=...), MLP).state_dict()."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    def linear(sd: dict, name: str, fan_out: int, fan_in: int) -> None:
        sd[f"{name}.weight"] = rand(fan_out, fan_in, scale=1 / math.sqrt(fan_in))
        sd[f"{name}.bias"] = rand(fan_out, scale=0.1)

    def norm(sd: dict, name: str, width: int) -> None:
        sd[f"{name}.weight"] = 1 + rand(width, scale=0.1)
        sd[f"{name}.bias"] = rand(width, scale=0.1)

    sd: dict[str, torch.Tensor] = {}
    v = "blip.visual_encoder."
    num_positions = 1 + (IMAGE_SIZE // PATCH) ** 2
    sd[v + "cls_token"] = rand(1, 1, VISION_WIDTH, scale=0.5)
    sd[v + "pos_embed"] = rand(1, num_positions, VISION_WIDTH, scale=0.5)
    sd[v + "patch_embed.proj.weight"] = rand(
        VISION_WIDTH, 3, PATCH, PATCH, scale=1 / math.sqrt(3 * PATCH * PATCH)
    )
    sd[v + "patch_embed.proj.bias"] = rand(VISION_WIDTH, scale=0.1)
    for i in range(VISION_DEPTH):
        block = f"{v}blocks.{i}."
        norm(sd, block + "norm1", VISION_WIDTH)
        linear(sd, block + "attn.qkv", 3 * VISION_WIDTH, VISION_WIDTH)
        linear(sd, block + "attn.proj", VISION_WIDTH, VISION_WIDTH)
        norm(sd, block + "norm2", VISION_WIDTH)
        linear(sd, block + "mlp.fc1", VISION_MLP, VISION_WIDTH)
        linear(sd, block + "mlp.fc2", VISION_WIDTH, VISION_MLP)
    norm(sd, v + "norm", VISION_WIDTH)

    t = "blip.text_encoder."
    sd[t + "embeddings.word_embeddings.weight"] = rand(VOCAB_SIZE, TEXT_WIDTH)
    sd[t + "embeddings.position_embeddings.weight"] = rand(TEXT_POSITIONS, TEXT_WIDTH, scale=0.5)
    # med.py registers position_ids as a persistent buffer, so ImageReward.pt holds it.
    sd[t + "embeddings.position_ids"] = torch.arange(TEXT_POSITIONS).expand(1, -1)
    norm(sd, t + "embeddings.LayerNorm", TEXT_WIDTH)
    for i in range(TEXT_DEPTH):
        layer = f"{t}encoder.layer.{i}."
        for attention, kv_width in (("attention", TEXT_WIDTH), ("crossattention", VISION_WIDTH)):
            linear(sd, f"{layer}{attention}.self.query", TEXT_WIDTH, TEXT_WIDTH)
            linear(sd, f"{layer}{attention}.self.key", TEXT_WIDTH, kv_width)
            linear(sd, f"{layer}{attention}.self.value", TEXT_WIDTH, kv_width)
            linear(sd, f"{layer}{attention}.output.dense", TEXT_WIDTH, TEXT_WIDTH)
            norm(sd, f"{layer}{attention}.output.LayerNorm", TEXT_WIDTH)
        linear(sd, layer + "intermediate.dense", TEXT_FFN, TEXT_WIDTH)
        linear(sd, layer + "output.dense", TEXT_WIDTH, TEXT_FFN)
        norm(sd, layer + "output.LayerNorm", TEXT_WIDTH)
    # BLIP_Pretrain's contrastive projections: saved in ImageReward.pt, unused by the score.
    linear(sd, "blip.vision_proj", 16, VISION_WIDTH)
    linear(sd, "blip.text_proj", 16, TEXT_WIDTH)

    for index, (fan_in, fan_out) in zip((0, 2, 4, 6, 7), zip(HEAD_SIZES, HEAD_SIZES[1:])):
        linear(sd, f"mlp.layers.{index}", fan_out, fan_in)
    return sd


def write_model(folder: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict, folder / "ImageReward.pt")
    med_config = {  # BLIP's med_config.json fields at tiny sizes
        "architectures": ["BertModel"],
        "attention_probs_dropout_prob": 0.1,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "hidden_size": TEXT_WIDTH,
        "initializer_range": 0.02,
        "intermediate_size": TEXT_FFN,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": TEXT_POSITIONS,
        "model_type": "bert",
        "num_attention_heads": TEXT_HEADS,
        "num_hidden_layers": TEXT_DEPTH,
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": VOCAB_SIZE,
        "encoder_width": 768,  # BLIP overrides it with the ViT width; the loader must too
        "add_cross_attention": True,
    }
    (folder / "med_config.json").write_text(json.dumps(med_config))
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("imagereward")
    state_dict = official_state_dict()
    model_dir = write_model(root / "model", state_dict)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return {"model": str(model_dir), "tokenizer": str(tokenizer_dir), "sd": state_dict, "root": root}


@pytest.fixture(scope="module")
def scorer(tiny) -> ImageRewardScorer:
    return build_reward("imagereward", model=tiny["model"], tokenizer=tiny["tokenizer"], device="cpu")


def noise_images(seed: int = 0) -> list[Image.Image]:
    sizes = ((16, 16), (20, 16), (33, 40), (16, 24), (48, 48))  # (w, h): squares, wide and tall
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)) for w, h in sizes]


# --------------------------------------------------------------------------- plain-torch references


def layer_norm(x: torch.Tensor, sd: dict, name: str, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * sd[name + ".weight"] + sd[name + ".bias"]


def dense(x: torch.Tensor, sd: dict, name: str) -> torch.Tensor:
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # nn.GELU / BERT "gelu": the erf form


def timm_vit(sd: dict, pixels_b3hw: torch.Tensor, num_heads: int) -> torch.Tensor:
    """BLIP's vit.VisionTransformer.forward on official-layout tensors (fused qkv), [B, 1 + patches, D]."""
    v = "blip.visual_encoder."
    weight = sd[v + "patch_embed.proj.weight"]
    width, channels, patch, _ = weight.shape
    b, _, h, w = pixels_b3hw.shape
    # Patchify by reshaping (row-major over the patch grid, as Conv2d + flatten(2)), then one matmul.
    patches = pixels_b3hw.reshape(b, channels, h // patch, patch, w // patch, patch)
    patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), -1)
    x = patches @ weight.reshape(width, -1).T + sd[v + "patch_embed.proj.bias"]
    x = torch.cat([sd[v + "cls_token"].expand(b, 1, width), x], dim=1) + sd[v + "pos_embed"]
    tokens, head_dim = x.shape[1], width // num_heads
    for i in range(VISION_DEPTH):
        block = f"{v}blocks.{i}."
        qkv = dense(layer_norm(x, sd, block + "norm1", 1e-6), sd, block + "attn.qkv")
        q, k, val = qkv.reshape(b, tokens, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) * head_dim**-0.5, dim=-1)
        x = x + dense((attn @ val).transpose(1, 2).reshape(b, tokens, width), sd, block + "attn.proj")
        hidden = gelu(dense(layer_norm(x, sd, block + "norm2", 1e-6), sd, block + "mlp.fc1"))
        x = x + dense(hidden, sd, block + "mlp.fc2")
    return layer_norm(x, sd, v + "norm", 1e-6)


def med_bert(sd: dict, ids_bl: torch.Tensor, mask_bl: torch.Tensor, image_btd: torch.Tensor) -> torch.Tensor:
    """BLIP med.py BertModel(mode="multimodal", is_decoder=False) on official-layout tensors, [B, L, H]."""
    t = "blip.text_encoder."
    b, length = ids_bl.shape
    head_dim = TEXT_WIDTH // TEXT_HEADS

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], TEXT_HEADS, head_dim).transpose(1, 2)

    def attention(x: torch.Tensor, kv: torch.Tensor, prefix: str, additive_mask) -> torch.Tensor:
        q = split(dense(x, sd, prefix + "self.query"))
        k, val = split(dense(kv, sd, prefix + "self.key")), split(dense(kv, sd, prefix + "self.value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        if additive_mask is not None:
            scores = scores + additive_mask
        context = (torch.softmax(scores, dim=-1) @ val).transpose(1, 2).reshape(b, length, TEXT_WIDTH)
        return layer_norm(
            dense(context, sd, prefix + "output.dense") + x, sd, prefix + "output.LayerNorm", 1e-12
        )

    x = (
        sd[t + "embeddings.word_embeddings.weight"][ids_bl]
        + sd[t + "embeddings.position_embeddings.weight"][:length]
    )
    x = layer_norm(x, sd, t + "embeddings.LayerNorm", 1e-12)
    additive_mask = (1.0 - mask_bl[:, None, None, :].float()) * -10000.0  # med.py get_extended_attention_mask
    for i in range(TEXT_DEPTH):
        layer = f"{t}encoder.layer.{i}."
        x = attention(x, x, layer + "attention.", additive_mask)
        x = attention(x, image_btd, layer + "crossattention.", None)  # image_atts are all ones
        hidden = gelu(dense(x, sd, layer + "intermediate.dense"))
        x = layer_norm(dense(hidden, sd, layer + "output.dense") + x, sd, layer + "output.LayerNorm", 1e-12)
    return x


def head_by_hand(sd: dict, feature_bd: torch.Tensor) -> torch.Tensor:
    """ImageReward.score's tail: MLP (Linear chain, dropouts off, no activations), then (r - mean) / std."""
    x = feature_bd
    for index in (0, 2, 4, 6, 7):
        x = x @ sd[f"mlp.layers.{index}.weight"].T + sd[f"mlp.layers.{index}.bias"]
    return (x.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072  # ImageReward.__init__ mean, std


# --------------------------------------------------------------------------- conversion


def test_converter_renames_official_keys(tiny):
    sd = tiny["sd"]
    vision, text, mlp = imagereward_to_transformers(sd)
    pairs = {  # official -> transformers (convert_blip_original_pytorch_to_hf.rename_key)
        "blip.visual_encoder.cls_token": "embeddings.class_embedding",
        "blip.visual_encoder.pos_embed": "embeddings.position_embedding",
        "blip.visual_encoder.patch_embed.proj.weight": "embeddings.patch_embedding.weight",
        "blip.visual_encoder.blocks.1.attn.qkv.weight": "encoder.layers.1.self_attn.qkv.weight",
        "blip.visual_encoder.blocks.0.attn.proj.bias": "encoder.layers.0.self_attn.projection.bias",
        "blip.visual_encoder.blocks.1.norm2.weight": "encoder.layers.1.layer_norm2.weight",
        "blip.visual_encoder.blocks.0.mlp.fc2.weight": "encoder.layers.0.mlp.fc2.weight",
        "blip.visual_encoder.norm.bias": "post_layernorm.bias",
    }
    for official, renamed in pairs.items():
        assert vision[renamed] is sd[official]
    key = "encoder.layer.1.crossattention.self.key.weight"
    assert text[key] is sd["blip.text_encoder." + key]
    assert mlp["7.bias"] is sd["mlp.layers.7.bias"]
    # 6 top-level + 12 per block; 4 embedding + 26 per layer; 5 linears x 2.
    assert (len(vision), len(text), len(mlp)) == (6 + 12 * VISION_DEPTH, 4 + 26 * TEXT_DEPTH, 10)
    assert "embeddings.position_ids" not in text  # buffer: transformers rebuilds it


def test_converter_lists_missing_and_unknown_keys(tiny):
    sd = dict(tiny["sd"])
    del sd["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    del sd["mlp.layers.6.bias"]
    sd["blip.itm_head.weight"] = torch.zeros(2, TEXT_WIDTH)
    with pytest.raises(ValueError, match="official layout") as info:
        imagereward_to_transformers(sd)
    message = str(info.value)
    for key in ("layer.1.crossattention.self.key.weight", "mlp.layers.6.bias", "blip.itm_head.weight"):
        assert key in message


def test_checkpoint_with_missing_key_fails_at_build(tiny):
    sd = dict(tiny["sd"])
    del sd["blip.visual_encoder.blocks.1.attn.qkv.bias"]
    broken = write_model(tiny["root"] / "broken", sd)
    with pytest.raises(
        ValueError, match=r"missing keys \[blip\.visual_encoder\.blocks\.1\.attn\.qkv\.bias\]"
    ):
        build_reward("imagereward", model=str(broken), tokenizer=tiny["tokenizer"], device="cpu")


def test_unreachable_hub_repo_error_names_the_fix(tiny):
    # conftest sets HF_HUB_OFFLINE=1: an uncached repo cannot be fetched.
    with pytest.raises(OSError, match="ImageReward.pt.*local folder"):
        build_reward(
            "imagereward", model="nobody/no-such-imagereward", tokenizer=tiny["tokenizer"], device="cpu"
        )


# --------------------------------------------------------------------------- forward parity


def test_derived_vision_config(scorer):
    config = scorer.vision.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 2, 2)
    assert (config.image_size, config.patch_size, config.intermediate_size) == (16, 8, 256)
    assert scorer.text.config.encoder_hidden_size == VISION_WIDTH  # not med_config's encoder_width 768


def test_vision_matches_timm_vit_reference(scorer, tiny):
    pixels = imagereward_preprocess(noise_images(), IMAGE_SIZE)
    with torch.no_grad():
        ours = scorer.vision(pixel_values=pixels).last_hidden_state
    reference = timm_vit(tiny["sd"], pixels, num_heads=VISION_WIDTH // 64)
    assert ours.shape == (5, 5, VISION_WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=2e-5)


def test_text_feature_matches_med_bert_reference(scorer, tiny):
    pixels = imagereward_preprocess(noise_images(), IMAGE_SIZE)
    ids, mask = scorer.tokenize(PROMPTS)
    image_embeds = timm_vit(tiny["sd"], pixels, num_heads=2)
    with torch.no_grad():
        ours = scorer.text(
            input_ids=ids, attention_mask=mask, encoder_hidden_states=image_embeds, is_decoder=False
        ).last_hidden_state
    reference = med_bert(tiny["sd"], ids, mask, image_embeds)
    # Padded positions differ only through -10000 vs dtype-min masking; compare the real tokens.
    for row in range(len(PROMPTS)):
        real = mask[row].bool()
        torch.testing.assert_close(ours[row, real], reference[row, real], rtol=0, atol=2e-5)


def test_score_is_normalised_head_of_position_zero(scorer, tiny):
    images = noise_images()
    scores = scorer(images, PROMPTS, [{}] * len(PROMPTS))
    assert scores.shape == (5,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    pixels = imagereward_preprocess(images, IMAGE_SIZE)
    ids, mask = scorer.tokenize(PROMPTS)
    sd = tiny["sd"]
    feature = med_bert(sd, ids, mask, timm_vit(sd, pixels, num_heads=2))[:, 0, :]
    torch.testing.assert_close(scores, head_by_hand(sd, feature), rtol=0, atol=2e-5)
    assert scores.std() > 0.05  # the comparison is not between near-constant outputs


def test_batching_and_order_invariance(scorer, tiny):
    images, metadata = noise_images(seed=1), [{}] * len(PROMPTS)
    full = scorer(images, PROMPTS, metadata)
    small_batches = build_reward(
        "imagereward", model=tiny["model"], tokenizer=tiny["tokenizer"], device="cpu", batch_size=2
    )(images, PROMPTS, metadata)
    torch.testing.assert_close(small_batches, full, rtol=0, atol=1e-5)
    singles = torch.cat([scorer([image], [prompt], [{}]) for image, prompt in zip(images, PROMPTS)])
    torch.testing.assert_close(singles, full, rtol=0, atol=1e-5)
    order = [3, 0, 4, 1, 2]
    shuffled = scorer([images[i] for i in order], [PROMPTS[i] for i in order], metadata)
    torch.testing.assert_close(shuffled, full[order], rtol=0, atol=1e-5)
    assert scorer([], [], []).shape == (0,)


def test_padding_tokens_are_masked(tiny):
    """Changing the [PAD] embedding leaves a short prompt's score alone; changing a used token's does not."""
    images, prompts = noise_images()[:2], ["a red cat", "green tree"]

    def score_with(edit_row: int) -> torch.Tensor:
        sd = dict(tiny["sd"])
        table = sd["blip.text_encoder.embeddings.word_embeddings.weight"].clone()
        # Not a constant shift: the embedding LayerNorm would cancel it.
        table[edit_row] += torch.linspace(-2.0, 2.0, TEXT_WIDTH)
        sd["blip.text_encoder.embeddings.word_embeddings.weight"] = table
        folder = write_model(tiny["root"] / f"edited_{edit_row}", sd)
        return build_reward("imagereward", model=str(folder), tokenizer=tiny["tokenizer"], device="cpu")(
            images, prompts, [{}, {}]
        )

    base = build_reward("imagereward", model=tiny["model"], tokenizer=tiny["tokenizer"], device="cpu")(
        images, prompts, [{}, {}]
    )
    torch.testing.assert_close(score_with(VOCAB.index("[PAD]")), base, rtol=0, atol=1e-5)
    assert (score_with(VOCAB.index("red")) - base).abs()[0] > 1e-3


def test_bfloat16_is_close_to_float32(scorer, tiny):
    bf16 = build_reward(
        "imagereward", model=tiny["model"], tokenizer=tiny["tokenizer"], device="cpu", dtype="bfloat16"
    )
    images = noise_images()
    scores = bf16(images, PROMPTS, [{}] * 5)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, scorer(images, PROMPTS, [{}] * 5), rtol=0, atol=0.15)


# --------------------------------------------------------------------------- goldens: tokens and pixels


def test_tokenisation_golden(scorer):
    tokenizer = scorer.tokenizer
    # init_tokenizer appends [DEC] (bos) then [ENC] after the 18 WordPiece entries (30522, 30523 for BERT).
    assert tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [18, 19]
    assert tokenizer.bos_token_id == 18
    ids, mask = scorer.tokenize(["A red cat", "Photos of the tree", "a " * 50])
    assert ids.shape == mask.shape == (3, 35)
    # [CLS]=2 a=5 red=6 cat=8 [SEP]=3, then [PAD]=0; position 0 stays [CLS] (ImageReward.score does not
    # write [ENC] there).
    assert ids[0].tolist() == [2, 5, 6, 8, 3] + [0] * 30
    assert mask[0].tolist() == [1] * 5 + [0] * 30
    assert ids[1, :7].tolist() == [2, 13, 15, 14, 11, 17, 3]  # photo ##s of the tree: lower-cased WordPiece
    assert ids[2].tolist() == [2] + [5] * 33 + [3] and mask[2].all()  # truncated to 35 with [SEP] kept


def test_preprocess_golden_values_and_crop():
    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    # A flat (200, 100, 50) image: (200/255 - 0.48145466) / 0.26862954 = 0.30285907 / 0.26862954 = 1.1274228,
    # (100/255 - 0.4578275) / 0.26130258 = -0.06567064 / 0.26130258 = -0.2513203,
    # (50/255 - 0.40821073) / 0.27577711 = -0.21213230 / 0.27577711 = -0.7692165.
    flat = imagereward_preprocess([Image.new("RGB", (40, 24), (200, 100, 50))], 16)
    assert flat.shape == (1, 3, 16, 16) and flat.dtype == torch.float32
    expected = torch.tensor([1.1274228, -0.2513203, -0.7692165])
    torch.testing.assert_close(flat[0, :, 5, 7], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(flat.amax(dim=(2, 3)), flat.amin(dim=(2, 3)))

    # Width 19 and 21 at height 16: no resize; torchvision's left offset int(round(3 / 2)) = 2 and
    # int(round(5 / 2)) = 2 (round half to even). Column c has red = 10 c, so output column 0 has red 20
    # and column 15 has red 170.
    for width in (19, 21):
        pixels = np.zeros((16, width, 3), dtype=np.uint8)
        pixels[:, :, 0] = (10 * np.arange(width)).astype(np.uint8)
        out = imagereward_preprocess([Image.fromarray(pixels)], 16)
        red = out[0, 0, 0] * clip_std[0] + clip_mean[0]
        torch.testing.assert_close(red[[0, 15]], torch.tensor([20 / 255, 170 / 255]), rtol=0, atol=1e-6)

    # 32 x 80 (w x h): short side 32 -> 16, long 80 -> int(16 * 80 / 32) = 40, crop rows 12..27. Source
    # rows 0..39 green, 40..79 white, so resized rows 0..19 green, 20..39 white (bicubic blurs only rows
    # within 2 of the edge): output row 0 (resized 12) is green, output row 15 (resized 27) is white.
    # An RGBA source checks RGB conversion.
    pixels = np.full((80, 32, 4), 255, dtype=np.uint8)
    pixels[:40, :, [0, 2]] = 0
    out = imagereward_preprocess([Image.fromarray(pixels, mode="RGBA")], 16)
    unnormalised = out[0] * torch.tensor(clip_std)[:, None, None] + torch.tensor(clip_mean)[:, None, None]
    torch.testing.assert_close(unnormalised[:, 0, 8], torch.tensor([0.0, 1.0, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(unnormalised[:, 15, 8], torch.tensor([1.0, 1.0, 1.0]), rtol=0, atol=1e-6)


def test_a_path_to_the_checkpoint_file_means_its_folder(tiny):
    from glm_training.rewards.imagereward import resolve_imagereward_files

    folder = Path(tiny["model"])
    assert resolve_imagereward_files(str(folder / "ImageReward.pt")) == resolve_imagereward_files(str(folder))

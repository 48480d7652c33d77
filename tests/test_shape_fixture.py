"""The real-width GLM-Image fixture (`model=glm_image_shape`): real configs, the plan's parameter counts, and
from_pretrained giving back what was built. Building it takes ~12 s and 3.5 GB of disk (bf16), once per
session; loading it ~3.5 GB of RAM."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from glm_training.models import shape

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shape_dir(tiny_cache):
    return shape.ensure_shape_pipeline(1, 1)


def test_saved_configs_are_the_real_ones(shape_dir):
    ar = json.loads((shape_dir / "vision_language_encoder" / "config.json").read_text())
    text, vision = ar["text_config"], ar["vision_config"]
    assert (text["hidden_size"], text["intermediate_size"]) == (4096, 13696)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (32, 2)
    assert (text["vocab_size"], text["vision_vocab_size"]) == (168064, 16512)
    assert (vision["hidden_size"], vision["patch_size"]) == (1536, 16)
    assert text["num_hidden_layers"] == vision["depth"] == 1
    dit = json.loads((shape_dir / "transformer" / "config.json").read_text())
    assert (dit["num_attention_heads"], dit["attention_head_dim"], dit["patch_size"]) == (32, 128, 2)
    assert (dit["in_channels"], dit["text_embed_dim"], dit["prior_vq_quantizer_codebook_size"]) == (
        16,
        1472,
        16384,
    )
    assert dit["num_layers"] == 1
    vae = json.loads((shape_dir / "vae" / "config.json").read_text())
    assert vae["latent_channels"] == 16 and len(vae["block_out_channels"]) == 4  # scale factor 8
    glyph = json.loads((shape_dir / "text_encoder" / "config.json").read_text())
    assert glyph["d_model"] == 1472
    # Saved in bf16: the vocabulary embedding alone is 168064 x 4096.
    (weights,) = (shape_dir / "vision_language_encoder").glob("*.safetensors")
    with safe_open(weights, "pt") as f:
        embed = f.get_slice("model.language_model.embed_tokens.weight")
        assert embed.get_shape() == [168064, 4096] and embed.get_dtype() == "BF16"


def test_the_plan_counts_the_saved_weights(shape_dir):
    # The plan's meta modules (configs only) hold exactly the parameters saved in the fixture's files (read
    # from the safetensors headers; the training tests below load them with from_pretrained).
    from glm_training.config import load_config
    from glm_training.plan import meta_components

    meta = meta_components(load_config(config="t2i_training", overrides=["model=glm_image_shape"]).model)
    for name, module in meta.items():
        saved = 0
        for weights in (shape_dir / name).glob("*.safetensors"):
            with safe_open(weights, "pt") as f:
                saved += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
        assert saved == sum(p.numel() for p in module.parameters()), name


def test_the_saved_folder_loads_as_built(shape_dir):
    # from_pretrained gives back every tensor the builder made, bit for bit (a weight left uninitialised, a
    # tie lost or a key renamed on the way would show). Training at these widths runs in
    # tests/test_gpu_check.py, through both trainers around the same builder's components.
    from diffusers import GlmImagePipeline

    loaded = GlmImagePipeline.from_pretrained(shape_dir, torch_dtype=torch.bfloat16)
    built = shape.build_shape_pipeline(1, 1)
    for name in ("text_encoder", "vision_language_encoder", "vae", "transformer"):
        expected, got = getattr(built, name).state_dict(), getattr(loaded, name).state_dict()
        assert expected.keys() == got.keys(), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), (name, key)

"""The real-width GLM-Image fixture (`model=glm_image_shape`): real configs, from_pretrained, one AR training
step at 256² on CPU: in bf16 autocast where the CPU computes bf16 in hardware, in float32 where
it would emulate it. Building it takes ~12 s and 3.5 GB of disk (bf16), once per session; loading it
~3.5 GB of RAM (7 GB in float32)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import PYTHON, run_cli
from safetensors import safe_open

from glm_training.environment import cpu_has_native_bf16
from glm_training.models import shape

pytestmark = pytest.mark.slow

# bf16 at 256² on a CPU that has it (AVX512-BF16 / AMX). On one that would emulate every bf16 matmul (hundreds
# of times slower: the two runs alone took over half an hour on an AVX2-only EPYC), float32 at 128², which
# keeps the suite in its budget there (each run took ~105 s in float32 at 256², ~55 s at 128²). The test
# checks the same either way: the real-width components load, plan, sample, score and take one finite step.
PRECISION_AND_SIZE = (
    ["trainer.mixed_precision=bf16", "sampling.height=256", "sampling.width=256"]
    if cpu_has_native_bf16()
    else ["trainer.mixed_precision=no", "model.dtype=float32", "sampling.height=128", "sampling.width=128"]
)
SHAPE_256 = [
    "model=glm_image_shape",
    "trainer.progress_bar=false",
    *PRECISION_AND_SIZE,
    "trainer.num_steps=1",
    "data.num_groups_per_step=1",
    "data.num_generations=2",
    "eval.every_n_steps=0",
    "logging.tensorboard=false",
]


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


def test_one_training_step_at_256(shape_dir, tmp_path):
    """The AR half through `train_ar.py`: every component loads from the saved folder, the AR model samples at
    256², the frozen DiT renders. (A DiT step at real widths runs in tests/test_gpu_check.py, through the
    trainer around the same components built in memory.)"""
    out = tmp_path / "run"
    extra = ["sampling.dit_num_steps=2", "algo.micro_batch_size=2", "algo.dynamic_sampling=false"]
    result = run_cli([PYTHON, "train_ar.py", *SHAPE_256, *extra, f"trainer.output_dir={out}"], timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert "[plan] memory plan per rank" in log
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and torch.isfinite(torch.tensor(record["loss"]))

"""The memory plan (`glm_training.plan`) and gradient checkpointing on both halves."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import GlmImagePipeline

from glm_training.config import ConfigError, load_config
from glm_training.models.folded_lora import FoldedLoRA
from glm_training.models.lora import add_lora_adapters
from glm_training.models.wrapper import enable_gradient_checkpointing
from glm_training.plan import (
    MemoryPlanError,
    build_plan,
    check_fits,
    lora_params,
    main,
    meta_components,
    saved_tensor_bytes,
)
from glm_training.plan.cli import main as plan_main

GB = 10**9


def _cfg(name: str, component: str = "dit", overrides=()):
    return load_config(
        config="ar_training" if component == "ar" else "t2i_training", overrides=[name, *overrides]
    )


def _terms(plan):
    return {t.name: t.bytes for t in plan.static}


def test_meta_counts_equal_the_loaded_tiny_model(tiny_model_dir):
    # The plan reads configs only (meta device); its counts must be those of the weights that load.
    meta = meta_components(_cfg("model=tiny").model)
    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    for name, module in meta.items():
        assert all(p.device.type == "meta" for p in module.parameters())
        assert sum(p.numel() for p in module.parameters()) == sum(
            p.numel() for p in getattr(pipe, name).parameters()
        ), name


def test_the_plan_builds_a_missing_tiny_model_with_real_tensors(tmp_path, monkeypatch):
    # Resolving "tiny" builds it on first use; that must not happen under the meta-device context.
    from glm_training.models.tiny import TINY_MODEL_VERSION

    monkeypatch.setenv("GLM_TRAINING_CACHE", str(tmp_path))
    meta = meta_components(_cfg("model=tiny").model)
    assert (tmp_path / f"tiny-glm-image-v{TINY_MODEL_VERSION}-seed0" / ".complete").is_file()
    assert sum(p.numel() for p in meta["transformer"].parameters()) > 0


def test_lora_count_equals_peft(tiny_model_dir):
    cfg = _cfg("model=tiny", overrides=["model.lora.enabled=true"])
    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    expected = lora_params(pipe.transformer, list(cfg.model.lora.target_modules), cfg.model.lora.rank)
    add_lora_adapters(pipe.transformer, cfg.model.lora)
    assert expected > 0
    assert expected == sum(p.numel() for p in pipe.transformer.parameters() if p.requires_grad)


def test_real_model_sizes_from_configs():
    plan = build_plan(
        _cfg("model=glm_image", overrides=["model.lora.enabled=false", "model.fp32_master_weights=false"])
    )
    terms = _terms(plan)
    # The DiT is ~7B parameters, the AR model ~9B plus its 40-layer vision tower (~1.1B): bf16, 2 bytes each.
    assert 6.5e9 < terms["weights: transformer"] / 2 < 7.5e9
    assert 9e9 < terms["weights: vision_language_encoder"] / 2 < 11.5e9
    # Full fine-tuning: bf16 gradients and two bf16 AdamW states of every DiT parameter.
    assert terms["gradients"] == terms["weights: transformer"]
    assert terms["optimizer state (AdamW)"] == 2 * terms["weights: transformer"]


def test_fp32_master_weights_cost_16_bytes_a_trained_parameter():
    cfg = _cfg("model=glm_image", overrides=["model.lora.enabled=false"])  # masters by default
    assert cfg.model.keeps_master_weights() and cfg.trainer.mixed_precision == "bf16"  # "no" -> the model's
    terms = _terms(build_plan(cfg))
    bf16 = terms["weights: transformer"]  # 2 bytes a parameter, every DiT parameter trains
    assert terms["float32 master weights"] == bf16  # + 2 bytes: the weights are 4 bytes each
    assert terms["gradients"] == 2 * bf16 and terms["optimizer state (AdamW)"] == 4 * bf16
    assert (
        bf16 + terms["float32 master weights"] + terms["gradients"] + terms["optimizer state (AdamW)"]
        == 8 * bf16
    )
    with pytest.raises(ConfigError, match="trainer.mixed_precision"):
        _cfg("model=glm_image", overrides=["model.lora.enabled=false", "trainer.mixed_precision=fp16"])


def test_fsdp_divides_the_trained_component_by_the_world_size():
    cfg = _cfg("model=glm_image", overrides=["model.lora.enabled=false", "data.num_groups_per_step=8"])
    ddp, fsdp = (build_plan(cfg, world_size=8, strategy=s) for s in ("ddp", "fsdp"))
    d, f = _terms(ddp), _terms(fsdp)
    for key in ("weights: transformer", "gradients", "optimizer state (AdamW)"):
        assert f[key] == pytest.approx(d[key] / 8)
    assert (
        f["weights: vision_language_encoder"] == d["weights: vision_language_encoder"]
    )  # frozen: replicated
    dit = meta_components(cfg.model)["transformer"]
    one_block = sum(p.numel() for p in dit.transformer_blocks[0].parameters())
    root = sum(p.numel() for p in dit.parameters()) - len(dit.transformer_blocks) * one_block
    assert f["FSDP gathered units"] == (2 * one_block + root) * 2  # bf16 weights
    assert fsdp.peak < ddp.peak


def test_fsdp_reference_offload_and_bf16_gathers_change_their_terms():
    full = ["model.lora.enabled=false", "algo.beta=0.04", "model.dtype=float32"]
    plain = _terms(build_plan(_cfg("model=glm_image", overrides=full), world_size=8, strategy="fsdp"))
    tuned = _terms(
        build_plan(
            _cfg(
                "model=glm_image",
                overrides=[*full, "trainer.fsdp_reference_offload=true", "trainer.mixed_precision=bf16"],
            ),
            world_size=8,
            strategy="fsdp",
        )
    )
    assert plain["KL reference copy"] == pytest.approx(plain["weights: transformer"])  # 1/8 each
    assert tuned["KL reference copy"] == 0  # its shards live in host memory
    assert tuned["FSDP gathered units"] == pytest.approx(plain["FSDP gathered units"] / 2)  # bf16, not fp32


@pytest.mark.parametrize("evaluates", [False, True])
def test_fsdp_sampling_gather_is_a_transient_of_the_whole_component(evaluates):
    full = [
        "model.lora.enabled=false",
        "trainer.mixed_precision=bf16",
        f"eval.every_n_steps={int(evaluates)}",
    ]
    on, off = (
        build_plan(
            _cfg("model=glm_image", overrides=[*full, f"trainer.fsdp_gather_for_rollout={flag}"]),
            world_size=8,
            strategy="fsdp",
        )
        for flag in ("true", "false")
    )
    dit = sum(p.numel() for p in meta_components(_cfg("model=glm_image").model)["transformer"].parameters())
    gather, vae = dit * 2 - _terms(on)["FSDP gathered units"], off.rollout.bytes
    assert on.rollout.name.startswith("FSDP sampling gather")
    assert off.rollout.name.startswith("rollout VAE decode")
    # A rollout decodes after the gathered weights are freed; evaluation holds them through its decode.
    assert on.rollout.bytes == pytest.approx(gather + vae if evaluates else max(gather, vae))
    assert on.peak > off.peak


def test_a_cached_prior_run_plans_no_ar_weights(tmp_path):
    live = build_plan(_cfg("model=glm_image"))
    cached = build_plan(_cfg("model=glm_image", overrides=[f"data.prior_cache={tmp_path}"]))
    ar = _terms(live)["weights: vision_language_encoder"]
    assert "weights: vision_language_encoder" not in _terms(cached)
    assert cached.peak == pytest.approx(live.peak - ar)


@pytest.mark.parametrize("lora", [True, False])
def test_diffusion_nft_plans_its_old_model(lora):
    cfg = load_config(config="nft_training", overrides=["model=glm_image", f"model.lora.enabled={lora}"])
    terms = _terms(build_plan(cfg))
    # The old model is a copy of what trains: the float32 adapters, or the DiT's float32 master weights.
    expected = terms["trainable (LoRA adapters)"] if lora else 2 * terms["weights: transformer"]
    assert terms["NFT old model"] == pytest.approx(expected)
    assert "NFT old model" not in _terms(build_plan(_cfg("model=glm_image")))


def test_a_run_that_cannot_fit_stops_naming_terms_and_fixes():
    cfg = _cfg(
        "model=glm_image",
        overrides=["model.lora.enabled=false", "sampling.height=1024", "sampling.width=1024"],
    )
    plan = build_plan(cfg, device_bytes=72 * GB)
    with pytest.raises(MemoryPlanError) as err:
        check_fits(plan)
    message = str(err.value)
    for text in (
        "optimizer state",
        "model.lora.enabled=true",
        "trainer.strategy=fsdp",
        "gradient_checkpointing",
    ):
        assert text in message
    # LoRA on the DiT at 512² fits one 80 GB GPU.
    check_fits(
        build_plan(_cfg("model=glm_image", overrides=["sampling.micro_batch_size=1"]), device_bytes=72 * GB)
    )


def test_checkpointing_lowers_the_planned_activations():
    base = ["model=glm_image", "sampling.height=1024", "sampling.width=1024"]
    off = build_plan(_cfg(base[0], overrides=[*base[1:], "model.gradient_checkpointing=false"]))
    on = build_plan(_cfg(base[0], overrides=[*base[1:], "model.gradient_checkpointing=true"]))
    assert on.activations.bytes < off.activations.bytes / 4
    assert on.activations_other.bytes == off.activations.bytes


def test_cli_prints_the_table_and_fails_when_it_does_not_fit(capsys):
    assert main(["--config", "configs/t2i_training.yaml", "model=glm_image", "--gpu-memory-gb", "80"]) == 0
    assert "weights: transformer" in capsys.readouterr().out
    args = ["--config", "configs/t2i_training.yaml", "model=glm_image", "model.lora.enabled=false"]
    assert main([*args, "--gpu-memory-gb", "80"]) == 1
    assert main([*args, "--gpu-memory-gb", "80", "--world-size", "8", "--strategy", "fsdp"]) == 0


# ---------------------------------------------------------------------------------------------------------
# Gradient checkpointing: same gradients, fewer saved activations, in eval mode (as the trainers run).


def _dit_loss(transformer):
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    return (
        transformer(
            hidden_states=torch.randn(2, cfg.in_channels, 8, 8, generator=g),
            encoder_hidden_states=torch.randn(2, 5, cfg.text_embed_dim, generator=g),
            prior_token_id=torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (2, 16), generator=g),
            prior_token_drop=torch.zeros(2, 16, dtype=torch.bool),
            timestep=torch.tensor([300.0, 700.0]),
            target_size=torch.tensor([[64.0, 64.0]] * 2),
            crop_coords=torch.zeros(2, 2),
            return_dict=False,
        )[0]
        .pow(2)
        .mean()
    )


def _ar_loss(ar):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    pos = torch.arange(12).view(1, 1, -1).expand(3, 2, -1)
    hidden = ar.model.language_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    return torch.log_softmax(ar.lm_head(hidden), -1).gather(-1, ids[..., None]).mean()


@pytest.mark.parametrize("component", ["dit", "ar"])
@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_plain_gradients(tiny_model_dir, component, lora):
    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    plain = pipe.transformer if component == "dit" else pipe.vision_language_encoder
    loss_fn = _dit_loss if component == "dit" else _ar_loss
    if lora:
        cfg = _cfg("model=tiny", component, ["model.lora.enabled=true"])
        add_lora_adapters(plain, cfg.model.lora)
    else:
        plain.requires_grad_(True)
    plain.eval()
    ckpt = copy.deepcopy(plain)
    # Tiny stacks: 2 DiT blocks; 2 GLM decoder layers + 2 vision-tower blocks.
    assert enable_gradient_checkpointing(ckpt) == (2 if component == "dit" else 4)

    results = []
    for module in (plain, ckpt):
        params = [p for p in module.parameters() if p.requires_grad]
        with saved_tensor_bytes(params) as saved:
            loss = loss_fn(module)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in params], sum(saved.values())))
    (loss_a, grads_a, saved_a), (loss_b, grads_b, saved_b) = results
    # The recompute runs the same float32 kernels on the same inputs: equal up to summation order.
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # And it really checkpoints in eval mode (transformers' layers alone would not): less is saved.
    assert saved_b < 0.8 * saved_a, (saved_a, saved_b)


def test_the_folded_sampler_plans_the_copies_it_allocates(tiny_model_dir):
    """The plan's term equals what `FoldedLoRA` allocates on the loaded tiny model (its attention
    projections' weights, in the model's dtype); the policy sampler plans none."""
    folded = ["model.lora.enabled=true", "sampling.sampler=folded"]
    terms = _terms(build_plan(_cfg("model=tiny", "ar", folded)))
    module = GlmImagePipeline.from_pretrained(tiny_model_dir).vision_language_encoder
    cfg = _cfg("model=tiny", "ar", folded)
    add_lora_adapters(module, cfg.model.lora)
    allocated = sum(linear.weight.nbytes for linear in FoldedLoRA(module).folded)
    assert terms["folded sampling copies"] == allocated > 0
    assert "folded sampling copies" not in _terms(
        build_plan(_cfg("model=tiny", "ar", ["model.lora.enabled=true"]))
    )


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--config", "recipes/flow_grpo_fast"], "recipes/flow_grpo_fast_ocr"),  # no such recipe: the list
        (
            ["--config", "recipes/flow_grpo_fast_ocr", "trainer.num_stepz=3"],
            "Did you mean 'trainer.num_steps'",
        ),
    ],
)
def test_the_plan_command_answers_a_user_error_in_one_line(argv, names, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and names in err and err.count("\n") == 1


def test_the_plan_command_says_what_the_usable_memory_is(capsys):
    assert plan_main(["--config", "recipes/flow_grpo_fast_ocr", "--gpu-memory-gb", "80"]) == 0
    assert "of 67.06 GiB usable" in capsys.readouterr().out  # 80e9 bytes x max_memory_fraction 0.9

"""LoRA through peft's own API (`glm_training.models.lora`), on both halves of the tiny GLM-Image.

diffusers' and transformers' adapter methods check the installed peft's version on every call, and a new
release of either can refuse today's peft (transformers 5.24 asked for a peft 0.22 that did not exist yet).
These tests make both libraries' checks refuse everything, then add, train, disable, merge and save adapters
on each half: the project's LoRA path must not go through them.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import GlmImagePipeline
from safetensors.torch import load_file

from glm_training.models.lora import (
    PEFT_WEIGHTS_FILE,
    adapter_inputs_uncast,
    adapters_disabled,
    add_lora_adapters,
    merge_lora_adapters,
    save_lora_adapters,
    tuner_layers,
)

LORA = SimpleNamespace(
    rank=4, alpha=8, dropout=0.0, target_modules=["to_q", "to_v", "q_proj", "v_proj"], init_weights="gaussian"
)


def _refuse(*args, **kwargs):
    raise ValueError("the integration layer's peft version check was called")


@pytest.fixture
def gates_refuse(monkeypatch):
    import diffusers.loaders.peft
    import transformers.integrations.peft

    monkeypatch.setattr(transformers.integrations.peft, "check_peft_version", _refuse)
    monkeypatch.setattr(diffusers.loaders.peft, "check_peft_version", _refuse)


def test_the_refusing_gates_do_refuse_the_libraries_own_methods(tiny_model_dir, gates_refuse):
    from peft import LoraConfig

    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    for module in (pipe.transformer, pipe.vision_language_encoder):
        with pytest.raises(ValueError, match="peft version check was called"):
            module.add_adapter(LoraConfig(r=4, target_modules=LORA.target_modules))


def _dit_call(module):
    g = torch.Generator().manual_seed(0)
    cfg = module.config
    latents = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
    hidden = torch.randn(1, 4, cfg.text_embed_dim, generator=g)
    prior = torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (1, 16), generator=g)
    return lambda: module(
        hidden_states=latents,
        encoder_hidden_states=hidden,
        prior_token_id=prior,
        prior_token_drop=torch.zeros(1, dtype=torch.bool),
        timestep=torch.tensor([500.0]),
        target_size=torch.tensor([[64.0, 64.0]]),
        crop_coords=torch.zeros(1, 2),
        return_dict=False,
    )[0]


def _ar_call(module):
    ids = torch.arange(1, 9).unsqueeze(0)
    return lambda: module(input_ids=ids).logits


@pytest.mark.parametrize("half", ["transformer", "vision_language_encoder"])
def test_adapters_train_disable_merge_and_save_without_the_integration_layer(
    tiny_model_dir, tmp_path, gates_refuse, half
):
    module = getattr(GlmImagePipeline.from_pretrained(tiny_model_dir), half).eval()
    call = (_dit_call if half == "transformer" else _ar_call)(module)
    with torch.no_grad():
        base = call()
    add_lora_adapters(module, LORA)
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in trained.values())
    with torch.no_grad():
        assert torch.equal(call(), base)  # lora_B starts at zero
        g = torch.Generator().manual_seed(1)
        for p in trained.values():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        adapted = call()
        assert not torch.allclose(adapted, base)
        with adapters_disabled(module) as reference:
            assert reference is module and torch.equal(call(), base)
        assert torch.equal(call(), adapted)  # switched back on

    save_lora_adapters(module, tmp_path / "adapter")
    if half == "vision_language_encoder":
        saved = load_file(str(tmp_path / "adapter" / PEFT_WEIGHTS_FILE))
        assert len(saved) == len(trained) and all(k.startswith("base_model.model.") for k in saved)
        config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["peft_type"] == "LORA"
    else:
        assert (tmp_path / "adapter" / "pytorch_lora_weights.safetensors").is_file()

    merge_lora_adapters(module)
    assert tuner_layers(module) == [] and "peft_config" not in vars(module)
    with torch.no_grad():
        torch.testing.assert_close(call(), adapted, rtol=1e-4, atol=1e-4)


def test_disabling_a_module_without_adapters_is_an_error(tiny_model_dir):
    module = GlmImagePipeline.from_pretrained(tiny_model_dir).transformer
    with pytest.raises(ValueError, match="no LoRA layers"), adapters_disabled(module):
        pass


@pytest.mark.parametrize("init, peft_init", [("gaussian", "gaussian"), ("default", True)])
def test_lora_init_weights_are_peft_s_own(tiny_model_dir, init, peft_init):
    # `model.lora.init_weights`: gaussian (Flow-GRPO, DiffusionNFT, AWM: init_lora_weights="gaussian") or
    # peft's default (TRL). The same draws as peft's own injection from the same seed; B starts at 0.
    from peft import LoraConfig, inject_adapter_in_model

    ours = GlmImagePipeline.from_pretrained(tiny_model_dir).transformer
    theirs = GlmImagePipeline.from_pretrained(tiny_model_dir).transformer
    torch.manual_seed(3)
    add_lora_adapters(ours, SimpleNamespace(**{**vars(LORA), "init_weights": init}))
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA.target_modules, init_lora_weights=peft_init)
    inject_adapter_in_model(config, theirs)
    expected = {n: p for n, p in theirs.named_parameters() if "lora_" in n}
    got = {n: p for n, p in ours.named_parameters() if "lora_" in n}
    assert got.keys() == expected.keys()
    for name, param in got.items():
        assert torch.equal(param.float(), expected[name].float()), name
        if "lora_B" in name:
            assert not param.any()
    a = next(p for n, p in got.items() if "lora_A" in n)
    if init == "gaussian":  # N(0, 1/r): std 0.25 at r = 4, beyond the Kaiming-uniform bound of these widths
        assert a.abs().max() > 1 / a.shape[1] ** 0.5


def _adapted_mlp() -> torch.nn.Module:
    """A bf16 two-layer block with float32 LoRA adapters (B non-zero), as the trainers hold them."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential()
    mlp.add_module("to_q", torch.nn.Linear(16, 32))
    mlp.add_module("act", torch.nn.GELU())
    mlp.add_module("to_v", torch.nn.Linear(32, 8))
    mlp = mlp.to(torch.bfloat16)
    add_lora_adapters(mlp, LORA)
    for name, p in mlp.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return mlp


def _forward_backward(mlp, uncast: bool):
    """(output, input gradient, adapter gradients) of one bf16-autocast pass, and the casts it launched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountCasts.casts += func is torch.ops.aten._to_copy.default
            return func(*args, **(kwargs or {}))

    mlp.zero_grad(set_to_none=True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    with CountCasts(), torch.autocast("cpu", torch.bfloat16):
        with adapter_inputs_uncast(mlp, "cpu") if uncast else contextlib.nullcontext():
            out = mlp(x)
        out.float().square().sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters() if p.requires_grad]
    return out.detach(), x.grad, grads, CountCasts.casts


def test_adapter_inputs_uncast_computes_the_same_numbers_with_fewer_casts():
    """Under autocast, skipping peft's cast of a LoRA input to the float32 adapters' dtype changes no number:
    bf16 -> float32 is exact and autocast casts it back to bf16 for the matmul. So both passes run the same
    matmul kernels on the same values, and outputs and gradients are compared bit for bit."""
    mlp = _adapted_mlp()
    out, x_grad, grads, casts = _forward_backward(mlp, uncast=False)
    out_u, x_grad_u, grads_u, casts_u = _forward_backward(mlp, uncast=True)
    assert torch.equal(out, out_u) and torch.equal(x_grad, x_grad_u)
    assert len(grads) == 4 and all(torch.equal(a, b) for a, b in zip(grads, grads_u, strict=True))
    # Two adapted layers, two casts each way: the input to float32 and back to bf16, then their gradients.
    assert casts - casts_u >= 8, (casts, casts_u)
    assert all(layer.cast_input_dtype_enabled for _, layer in tuner_layers(mlp))  # restored


def test_adapter_inputs_stay_cast_outside_autocast_and_for_other_adapter_dtypes():
    mlp = _adapted_mlp()
    with adapter_inputs_uncast(mlp, "cpu"):  # no autocast: peft's cast is what makes bf16 x meet fp32 A
        assert all(layer.cast_input_dtype_enabled for _, layer in tuner_layers(mlp))
        assert mlp(torch.ones(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16
    for name, p in mlp.named_parameters():
        if "to_v.lora" in name:
            p.data = p.data.half()  # neither float32 nor the autocast dtype: the cast would change values
    with torch.autocast("cpu", torch.bfloat16), adapter_inputs_uncast(mlp, "cpu"):
        flags = {name: layer.cast_input_dtype_enabled for name, layer in tuner_layers(mlp)}
    assert flags == {"to_q": False, "to_v": True}

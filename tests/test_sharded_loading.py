"""Building the trained half empty, for reading it into shards (`distributed/loading.py`), in one process.

The whole path (empty build, LoRA on it, sharding, each rank reading its rows, equality with a whole load bit
for bit, the KL reference and the offloaded reference too) runs under torchrun in tests/test_fsdp.py; here,
what can be checked without a process group: the empty module is the loaded one but for its storage, peft's
adapters keep their drawn values, and a checkpoint that cannot fill the module is refused by name.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from diffusers import GlmImagePipeline
from safetensors.torch import load_file, save_file
from torch import nn

from glm_training.config import load_config
from glm_training.distributed.loading import (
    check_loadable,
    empty_component,
    file_key,
    materialise_,
    standin_weights,
)
from glm_training.models.lora import add_lora_adapters
from glm_training.models.placement import PlacementError
from glm_training.plan import loading_host_plan

COMPONENTS = ("transformer", "vision_language_encoder")


@pytest.fixture(scope="module")
def whole(tiny_model_dir):
    return GlmImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)


@pytest.mark.parametrize("attribute", COMPONENTS)
def test_the_empty_component_is_the_loaded_one_without_storage(tiny_model_dir, whole, attribute):
    loaded = getattr(whole, attribute)
    empty = empty_component(tiny_model_dir, attribute, torch.bfloat16)
    assert type(empty) is type(loaded) and not empty.training
    params, buffers = dict(empty.named_parameters()), dict(empty.named_buffers())
    assert {n: (p.shape, p.dtype) for n, p in params.items()} == {
        n: (p.shape, p.dtype) for n, p in loaded.named_parameters()
    }
    assert {p.device.type for p in params.values()} == {"meta"}
    # Buffers (the rotary frequencies) are computed as the library computes them, in its dtype.
    for name, buffer in loaded.named_buffers():
        assert buffers[name].dtype == buffer.dtype and torch.equal(buffers[name], buffer), name
    if attribute == "vision_language_encoder":
        assert empty.generation_config.to_dict() == loaded.generation_config.to_dict()
        assert empty.config._attn_implementation == loaded.config._attn_implementation
    check_loadable(empty, tiny_model_dir / attribute)  # every weight is in the files


def test_lora_on_the_empty_module_draws_the_adapters_of_a_whole_load(tiny_model_dir, whole):
    lora = load_config(config="t2i_training", overrides=["model.lora.enabled=true"]).model.lora
    loaded = GlmImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).transformer
    empty = empty_component(tiny_model_dir, "transformer", torch.bfloat16)
    torch.manual_seed(3)
    add_lora_adapters(loaded, lora)
    torch.manual_seed(3)
    with standin_weights(empty):
        add_lora_adapters(empty, lora)
    adapters = {n: p for n, p in empty.named_parameters() if "lora_" in n}
    assert adapters and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in adapters.values())
    reference = dict(loaded.named_parameters())
    assert all(torch.equal(p, reference[n]) for n, p in adapters.items())
    assert any(p.abs().sum() > 0 for p in adapters.values())  # lora_A drawn, not zero
    # The base weights are meta again, frozen, under peft's names; the files know them without base_layer.
    base = {n: p for n, p in empty.named_parameters() if "lora_" not in n}
    assert {p.device.type for p in base.values()} == {"meta"}
    assert not any(p.requires_grad for p in base.values())
    assert "transformer_blocks.0.attn1.to_q.base_layer.weight" in base
    assert (
        file_key("transformer_blocks.0.attn1.to_q.base_layer.weight")
        == "transformer_blocks.0.attn1.to_q.weight"
    )
    check_loadable(empty, tiny_model_dir / "transformer")


def test_a_checkpoint_missing_a_weight_is_refused_naming_it_and_the_fix(tiny_model_dir, tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_model_dir / "transformer", folder)
    file = folder / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(file))
    del weights["proj_out.weight"]
    save_file(weights, str(file))
    empty = empty_component(tiny_model_dir, "transformer", torch.float32)
    with pytest.raises(PlacementError, match=r"missing: proj_out\.weight.*fsdp_load_into_shards=false"):
        check_loadable(empty, folder)
    save_file({"proj_out.weight": torch.zeros(1)}, str(folder / "diffusion_pytorch_model.fp16.safetensors"))
    weights["proj_out.weight"] = torch.zeros(1)
    save_file(weights, str(file))
    with pytest.raises(PlacementError, match=r"proj_out\.weight is in both"):
        check_loadable(empty, folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    with pytest.raises(PlacementError, match="no .safetensors files"):
        check_loadable(empty, folder)


def test_tied_weights_are_refused_before_anything_is_sharded(tmp_path):
    with torch.device("meta"):
        module = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    module[1].weight = module[0].weight
    with pytest.raises(PlacementError, match=r"1\.weight and 0\.weight are one tied parameter"):
        check_loadable(module, tmp_path)


def test_an_empty_module_read_from_the_files_equals_the_loaded_one(tiny_model_dir, whole):
    """In one process (torch.distributed.checkpoint then reads as one rank) and unsharded: the float32 files
    converted to bfloat16 as from_pretrained converts them, buffers and drawn adapters kept."""
    lora = load_config(config="ar_training", overrides=["model.lora.enabled=true"]).model.lora
    loaded = GlmImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).vision_language_encoder
    empty = empty_component(tiny_model_dir, "vision_language_encoder", torch.bfloat16)
    for module in (loaded, empty):
        torch.manual_seed(5)
        with standin_weights(module):
            add_lora_adapters(module, lora)
    materialise_(empty, tiny_model_dir / "vision_language_encoder", torch.device("cpu"))
    expected = dict([*loaded.named_parameters(), *loaded.named_buffers()])
    got = dict([*empty.named_parameters(), *empty.named_buffers()])
    assert got.keys() == expected.keys()
    for name, value in got.items():
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name]), name
    assert {t.device.type for t in got.values()} == {"cpu"}


def _loading(overrides, world_size=8, device="cpu"):
    cfg = load_config(config="t2i_training", overrides=["model=glm_image", *overrides])
    return loading_host_plan(cfg, world_size=world_size, strategy="fsdp", device=device)


def test_the_loading_plan_of_a_full_fine_tune_read_into_shards_is_an_eighth_of_a_whole_load():
    """Full fine-tune of the bf16 DiT with float32 masters and a KL reference, 8 ranks, trained on the CPU:
    loaded whole each rank touches the file (2 bytes a parameter) and holds the reference (2) and the masters
    (4); read into shards, an eighth of each."""
    full = ["model.lora.enabled=false", "algo.beta=0.04"]
    into, whole = _loading(full), _loading([*full, "trainer.fsdp_load_into_shards=false"])
    base = {t.name: t.bytes for t in into.terms}["libraries, configs, tokenizers"]
    assert whole.peak - base == pytest.approx(8 * (into.peak - base))
    assert {t.name for t in into.terms} >= {"KL reference shards", "transformer shards"}
    # LoRA: no reference and no masters: loaded whole, sharding copies this rank's rows out of the mapped
    # file, which costs what reading them does.
    lora = ["model.lora.enabled=true"]
    assert _loading(lora).peak == _loading([*lora, "trainer.fsdp_load_into_shards=false"]).peak
    # On a GPU the host only passes pages through: the frozen AR model's (18 GB) is then the peak.
    gpu = _loading(full, device="cuda")
    assert [t.name for t in gpu.terms][-1] == "frozen component passing through" and gpu.peak < whole.peak


def test_a_rotary_buffer_saved_in_the_checkpoint_is_not_read_as_from_pretrained_drops_it(
    tiny_model_dir, tmp_path, caplog
):
    """Non-persistent buffers are the module's own (computed); a file that holds one anyway (older exports
    did) is ignored, with a warning, as from_pretrained ignores it."""
    name = "model.language_model.rotary_emb.inv_freq"
    folder = tmp_path / "vision_language_encoder"
    shutil.copytree(tiny_model_dir / "vision_language_encoder", folder)
    file = folder / "model.safetensors"
    weights = load_file(str(file))
    empty = empty_component(tiny_model_dir, "vision_language_encoder", torch.float32)
    computed = empty.get_buffer(name).clone()
    weights[name] = torch.zeros_like(computed)
    save_file(weights, str(file))
    with caplog.at_level("WARNING"):
        check_loadable(empty, folder)
    assert f"not used by the module: {name}" in caplog.text
    materialise_(empty, folder, torch.device("cpu"))
    assert torch.equal(empty.get_buffer(name), computed) and computed.abs().sum() > 0


def test_the_loading_plan_reads_the_files_dtypes_and_knows_what_each_way_touches(tiny_model_dir, tmp_path):
    """The tiny model's files are float32: loaded in bf16 every component is converted (held on the CPU);
    under DDP on the CPU nothing else is touched while loading; on a GPU an offloaded reference keeps its
    shards in host memory."""
    cfg = load_config(
        config="t2i_training",
        overrides=["model.dtype=bfloat16", "model.lora.enabled=false", "algo.beta=0.04"],
    )
    pipe = GlmImagePipeline.from_pretrained(tiny_model_dir)
    numels = {
        n: sum(p.numel() for p in getattr(pipe, n).parameters())
        for n in ("vision_language_encoder", "transformer", "text_encoder", "vae")
    }
    ddp = {t.name: t.bytes for t in loading_host_plan(cfg, world_size=1, strategy="ddp", device="cpu").terms}
    frozen = sum(v for k, v in numels.items() if k != "transformer")
    assert ddp["frozen components (converted)"] == 2 * frozen  # every float32 element into 2 bytes
    dit = numels["transformer"]
    assert ddp["transformer file pages"] == 4 * dit and ddp["transformer (converted)"] == 2 * dit
    assert ddp["KL reference copy"] == 2 * dit and ddp["float32 masters"] == 4 * dit
    # (On cached prior tokens, so that no frozen AR model passing through is the GPU run's peak.)
    offload = [
        "trainer.fsdp_reference_offload=true",
        "trainer.fsdp_load_into_shards=false",
        f"data.prior_cache={tmp_path}",
    ]
    cfg = load_config(
        config="t2i_training", overrides=["model.lora.enabled=false", "algo.beta=0.04", *offload]
    )
    gpu = {
        t.name: t.bytes for t in loading_host_plan(cfg, world_size=4, strategy="fsdp", device="cuda").terms
    }
    assert gpu["KL reference shards"] == 4 * dit / 4  # float32 model: 4 bytes, a quarter per rank

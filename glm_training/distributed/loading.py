"""Loading the trained half straight into its FSDP2 shards (`trainer.fsdp_load_into_shards`, on by default).

Loaded whole, every rank of an FSDP run read the entire pipeline into host memory, moved it to its device and
only then sharded the trained half (a full fine-tune with a KL term deep-copied it first: two whole copies a
rank). Eight ranks of a node each read ~34 GB of bf16 weights before any sharding. Here no rank ever holds the
whole trained half, nor the whole KL reference:

1. The frozen components load as before (`from_pretrained` on the CPU, then to this rank's device). The
   trained one is not read: `empty_component` builds it from its config with its parameters on the meta
   device (accelerate's `init_empty_weights`; buffers such as the rotary frequencies are computed on the CPU,
   as the library computes them), in the dtype `from_pretrained` would give it.
2. The trainer sets it up as it would a loaded one: LoRA adapters, the KL reference copy, float32 masters,
   gradient checkpointing; on meta tensors that costs nothing. peft creates each adapter on the CPU from the
   seeded generator and then moves it to its base layer's device (meta would drop its values):
   `standin_weights` lends every meta parameter a one-element CPU tensor broadcast to its shape for that
   call, so the adapters keep their values, drawn exactly as in a whole load.
3. FSDP2 shards it as it is (`sharding.shard`); `materialise_` then allocates this rank's shards
   (`to_empty`), puts back what was real before (the adapters, the buffers) and reads each rank's rows of
   every weight from the component's safetensors files (`torch.distributed.checkpoint.load` with its
   `HuggingFaceStorageReader`: safetensors reads a slice of each tensor, and the file's dtype is converted
   to the parameter's as `from_pretrained` converts it).

The result equals a whole load then sharded, bit for bit (tests/test_fsdp.py runs both). No meta tensor is
ever moved to a device (the meta-tensor seed; a dtype cast of one, as `empty_component` makes, moves no
data): the frozen components are checked and moved without the trained one, which only gets storage through
`to_empty`. A checkpoint whose names do not match the module (a conversion that `from_pretrained` would
apply) is refused before anything is sharded, naming the keys.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from glm_training.models.placement import PlacementError

logger = logging.getLogger(__name__)

# peft keeps the adapted layer as `<name>.base_layer`; its weights are the file's `<name>.weight`.
PEFT_BASE = ".base_layer"


def local_pipeline_folder(path: str) -> Path:
    """The local folder of a pipeline: `path` itself, or the Hugging Face cache's snapshot of a hub id,
    fetched if it is not there yet (the trainers call it on rank 0 first, under the stage timeout; offline,
    the cache must hold it)."""
    if Path(path).is_dir():
        return Path(path)
    from diffusers import DiffusionPipeline

    return Path(DiffusionPipeline.download(path))


def _component_class(folder: Path, attribute: str) -> type:
    library, class_name = json.loads((folder / "model_index.json").read_text())[attribute]
    if library == "diffusers":
        import diffusers

        return getattr(diffusers, class_name)
    import transformers

    return getattr(transformers, class_name)


def empty_component(folder: Path, attribute: str, dtype: torch.dtype) -> nn.Module:
    """The pipeline's `attribute` built from its config, its parameters on the meta device in `dtype`.

    transformers' models are built as `from_pretrained` builds them (`_from_config` with the dtype, and the
    folder's generation config); diffusers' in float32 and then cast, as diffusers casts a loaded model.
    """
    from accelerate import init_empty_weights

    cls = _component_class(folder, attribute)
    sub = folder / attribute
    with init_empty_weights(include_buffers=False):
        if hasattr(cls, "load_config"):  # diffusers
            module = cls.from_config(cls.load_config(sub))
            nn.Module.to(module, dtype=dtype)  # a dtype cast of meta tensors: no data moves
        else:
            from transformers import AutoConfig, GenerationConfig

            module = cls._from_config(AutoConfig.from_pretrained(sub), dtype=dtype)
            if (sub / "generation_config.json").is_file():
                module.generation_config = GenerationConfig.from_pretrained(sub)
    return module.eval()


def empty_trained_component(path: str, attribute: str, dtype: torch.dtype) -> tuple[nn.Module, Path]:
    """The trained component of the pipeline at `path` built empty from its config, checked readable from its
    files before anything is sharded; with the folder of its weights (`GLMImageWrapper`'s `build_empty`)."""
    folder = local_pipeline_folder(path)
    module = empty_component(folder, attribute, dtype)
    check_loadable(module, folder / attribute)
    return module, folder / attribute


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise PlacementError(
            f"{folder} holds no .safetensors files to read the trained component's shards from; set "
            "trainer.fsdp_load_into_shards=false to load it whole (from_pretrained reads other formats)."
        )
    return files


def file_keys(folder: Path) -> set[str]:
    """Every tensor name in the folder's safetensors files; a name in two files (another variant of the
    weights beside them, such as `*.fp16.safetensors`) is refused: the reader would take both."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in where:
                    raise PlacementError(
                        f"{key} is in both {where[key]} and {file.name} in {folder}: reading into shards "
                        "takes every .safetensors file of the folder; keep one variant of the weights there, "
                        "or set trainer.fsdp_load_into_shards=false."
                    )
                where[key] = file.name
    return set(where)


def file_key(name: str) -> str:
    """The checkpoint's name of a module's parameter (peft's adapted layers keep theirs as `base_layer`)."""
    return name.replace(PEFT_BASE + ".", ".")


def _meta_names(module: nn.Module) -> list[str]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return [n for n, t in named if t.device.type == "meta"]


def _loadable_names(module: nn.Module) -> set[str]:
    """Names of what a checkpoint may fill: parameters and persistent buffers (a state dict's keys)."""
    names = {n for n, _ in module.named_parameters()}
    for prefix, sub in module.named_modules():
        for name in sub._buffers:
            if name not in sub._non_persistent_buffers_set and sub._buffers[name] is not None:
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


def check_loadable(module: nn.Module, folder: Path) -> None:
    """Refuse, before anything is sharded, a checkpoint that cannot fill `module`: a weight missing from the
    files (a key the library renames while loading) or weights tied to each other (`to_empty` would untie
    them)."""
    seen: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            raise PlacementError(
                f"{name} and {seen[id(param)]} are one tied parameter, which loading into shards would "
                "untie; set trainer.fsdp_load_into_shards=false to load the trained component whole."
            )
        seen[id(param)] = name
    in_files = file_keys(folder)
    missing = sorted(set(map(file_key, _meta_names(module))) - in_files)
    unexpected = sorted(in_files - {file_key(n) for n in _loadable_names(module)})
    if unexpected:  # from_pretrained drops them with a warning; so does this
        logger.warning("[load] %s: not used by the module: %s", folder, ", ".join(unexpected[:10]))
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise PlacementError(
            f"the weights in {folder} do not name every parameter of the module built from its config "
            f"(missing: {shown}); the checkpoint may need the renaming from_pretrained applies. Set "
            "trainer.fsdp_load_into_shards=false to load the trained component whole."
        )


@contextlib.contextmanager
def standin_weights(module: nn.Module) -> Iterator[nn.Module]:
    """Every meta parameter of `module` replaced, for the block, by a real tensor of its shape and dtype that
    holds one element (a broadcast zero), then put back (with the stand-in's `requires_grad`).

    For peft's adapter injection on an empty module: peft moves a new adapter to its base layer's device
    and dtype, and a meta base would leave the adapter without its values. peft reads only the base
    weights' device and dtype for the initialisations `add_lora_adapters` uses (`model.lora.init_weights`,
    drawn from the generator); initialisations that read the base values (PiSSA, OLoRA, LoftQ) would see
    zeros.
    """
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.device.type == "meta":
                standin = nn.Parameter(
                    torch.zeros((), dtype=param.dtype).expand(param.shape), requires_grad=param.requires_grad
                )
                sub._parameters[name] = standin
                swapped.append((sub, name, param))
    try:
        yield module
    finally:
        for sub, name, param in swapped:
            param.requires_grad_(sub._parameters[name].requires_grad)
            sub._parameters[name] = param


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter; the tensor itself otherwise."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


@torch.no_grad()
def materialise_(
    module: nn.Module, folder: Path, device: torch.device, buffers_device: torch.device | None = None
) -> None:
    """Collective: give a sharded module built on the meta device its storage on `device` and read this
    rank's part of each of its weights from the safetensors files in `folder`. `buffers_device`: where the
    buffers go when it is not `device` (the GPU, for shards offloaded to host memory: FSDP2 keeps buffers on
    the device).

    Tensors that were real before and are not in the files (LoRA adapters, rotary frequencies) keep their
    values; every meta parameter and buffer must be in the files (`check_loadable`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    in_files = file_keys(folder)
    loadable = _loadable_names(module)
    named = dict([*module.named_parameters(), *module.named_buffers()])
    # What is meta, and any persistent buffer the files hold (from_pretrained would load it too).
    to_read = {
        n for n, t in named.items() if t.device.type == "meta" or (n in loadable and file_key(n) in in_files)
    }
    kept = {n: _local(t).clone() for n, t in named.items() if n not in to_read}
    module.to_empty(device=device)
    named = dict([*module.named_parameters(), *module.named_buffers()])
    for name, value in kept.items():
        _local(named[name]).copy_(value)
    # Names of the tensors after `to_empty` (it replaces every tensor; FSDP2 re-registers its shards).
    state = {file_key(n): named[n] for n in to_read}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
    if buffers_device is not None:
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[name] = buffer.to(buffers_device)
    logger.info(
        "[load] %s: %d tensors read into this rank's shards from %s",
        type(module).__name__,
        len(state),
        folder,
    )


__all__ = [
    "check_loadable",
    "empty_component",
    "file_keys",
    "local_pipeline_folder",
    "materialise_",
    "standin_weights",
]

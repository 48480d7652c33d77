"""The loading plan: each rank's host memory while a run loads and shards its model.

What the libraries do, as measured on the real-width fixture: `from_pretrained` maps a safetensors file whose
dtype is the model's and reads nothing (its pages become resident as they are touched); a file in another
dtype is converted into new tensors. Touching a mapped weight (copying it, upcasting it, sharding it,
moving it to a GPU) makes its file pages resident until the last tensor of the file is gone. The sizes come
from the safetensors headers of a local pipeline folder, or from the meta components' parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.models.halves import ModelHalf, model_half
from glm_training.plan.components import DTYPE_BYTES, meta_components, not_loaded, numel
from glm_training.plan.report import GIB, LoadingPlan, Term
from glm_training.plan.sharding import shard_count
from glm_training.plan.state import has_reference

# What loading holds besides the weights (configs, tokenizers, the processor, from_pretrained's bookkeeping):
# measured on the real-width fixture (`benchmarks/bench_checkpoint_memory.py`: 0.083-0.085 GiB), rounded up.
LOADING_OVERHEAD_BYTES = 0.1 * GIB


@dataclass(frozen=True)
class _Loading:
    """How this rank loads: what every term of the loading plan reads."""

    cfg: Any
    shard: int
    into_shards: bool  # read into shards (`trainer.fsdp_load_into_shards`), not loaded whole
    on_cpu: bool  # the ranks train on the CPU
    dtype: torch.dtype
    wbytes: int
    folder: Path | None  # the local pipeline folder, if known


def _weights_folder(model_cfg: Any) -> Path | None:
    """The local pipeline folder of a model (without building a fixture that is not built yet), or None."""
    from glm_training.models import shape, tiny

    if model_cfg.name == "tiny":
        folder = tiny.ensure_tiny_pipeline(seed=model_cfg.tiny_seed)
    elif model_cfg.name == shape.SHAPE_MODEL_NAME:
        folder = tiny.default_cache_dir() / shape.shape_folder_name(
            *model_cfg.shape_layers(), model_cfg.tiny_seed
        )
    else:
        folder = Path(model_cfg.name).expanduser()
    return folder if (folder / "model_index.json").is_file() else None


def _file_weights(folder: Path | None, name: str, dtype: torch.dtype) -> tuple[float, int] | None:
    """(bytes, elements `from_pretrained` converts to `dtype`) of a component's safetensors files, from their
    headers only (a name in several files counted once); None when the folder is unknown."""
    if folder is None or not list((folder / name).glob("*.safetensors")):
        return None
    from safetensors import safe_open
    from safetensors.torch import _getdtype

    total, converted, seen = 0.0, 0, set()
    for file in sorted((folder / name).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in seen:
                    continue
                seen.add(key)
                piece = f.get_slice(key)
                count = 1
                for size in piece.get_shape():
                    count *= size
                file_dtype = _getdtype(piece.get_dtype())
                total += count * torch.empty(0, dtype=file_dtype).element_size()
                if file_dtype.is_floating_point and file_dtype != dtype:
                    converted += count
    return total, converted


def _frozen(ld: _Loading, modules: dict[str, nn.Module], half: ModelHalf) -> tuple[float, float]:
    """(bytes of frozen components converted on the CPU and held, the largest one's file pages passing
    through): converted ones are held on the CPU and pass through on a GPU; the others pass through to a
    GPU."""
    skipped = not_loaded(ld.cfg)
    converted, passing = 0.0, 0.0
    for name, module in modules.items():
        if name == half.attribute or name in skipped:
            continue
        file_bytes, to_convert = _file_weights(ld.folder, name, ld.dtype) or (numel(module) * ld.wbytes, 0)
        if to_convert and ld.on_cpu:
            converted += to_convert * ld.wbytes
        if to_convert or not ld.on_cpu:  # converted, or moved to the GPU: its pages pass through
            passing = max(passing, file_bytes)
    return converted, passing


def _trained_terms(ld: _Loading, trained: nn.Module, half: ModelHalf) -> list[Term]:
    """The trained component's terms at its loading peak, by the way it loads.

    * Loaded whole (DDP, or `trainer.fsdp_load_into_shards=false`): a KL reference copy or float32 masters
      touch the whole trained file and are made whole before sharding; with neither, sharding copies this
      rank's rows out of the mapped file (and DDP touches nothing while loading). On a GPU the component is
      moved there first: the host holds only the pages of the component being moved.
    * Read into shards: this rank's shards (masters, reference) and the pages of its rows of the file; on a
      GPU only those pages.
    """
    m, shard, name = ld.cfg.model, ld.shard, half.attribute
    n = numel(trained)  # the KL reference is a copy of the whole component
    n_train = sum(numel(p) for p in half.trained_parts(trained))
    file_bytes, to_convert = _file_weights(ld.folder, name, ld.dtype) or (n * ld.wbytes, 0)
    masters = m.keeps_master_weights()
    reference = has_reference(ld.cfg)
    offloaded = reference and shard > 1 and ld.cfg.trainer.fsdp_reference_offload
    terms: list[Term] = []
    if ld.into_shards:
        terms.append(Term("its file pages this rank reads", file_bytes / shard, f"1/{shard} of the file"))
        if ld.on_cpu:
            pbytes = 4 if masters else ld.wbytes
            shards = (n_train * pbytes + (n - n_train) * ld.wbytes) / shard
            detail = f"1/{shard}, {'float32 masters' if masters else m.dtype}"
            terms.append(Term(f"{name} shards", shards, detail))
    elif ld.on_cpu and (reference or masters or to_convert):
        terms.append(Term(f"{name} file pages", file_bytes, "the whole file, touched"))
        if to_convert:
            terms.append(Term(f"{name} (converted)", to_convert * ld.wbytes, f"into {m.dtype}"))
        if reference:
            terms.append(Term("KL reference copy", n * ld.wbytes, "whole, before sharding"))
        if masters:
            terms.append(Term("float32 masters", n_train * 4, "whole, before sharding"))
    elif ld.on_cpu and shard > 1:
        detail = f"sharding copies 1/{shard} of the file"
        terms.append(Term("its file pages this rank reads", file_bytes / shard, detail))
        terms.append(Term(f"{name} shards", n * ld.wbytes / shard, f"1/{shard}, {m.dtype}"))
    elif not ld.on_cpu:
        terms.append(Term(f"{name} file pages", file_bytes, "passing through to the GPU"))
    # (DDP on the CPU touches nothing while loading: the mapped file becomes resident as training reads it.)
    # The reference's shards in host memory: on a CPU when read into shards (loaded whole, its whole copy
    # above is the peak), on a GPU run when they are offloaded.
    if reference and ((ld.into_shards and ld.on_cpu) or (offloaded and not ld.on_cpu)):
        where = f"1/{shard}" + (" in host memory (fsdp_reference_offload)" if offloaded else "")
        terms.append(Term("KL reference shards", n * ld.wbytes / shard, where))
    return terms


def loading_host_plan(
    cfg: Any,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    device: str = "cuda",
    modules: dict[str, nn.Module] | None = None,
) -> LoadingPlan:
    """Each rank's host memory while loading, at its peak (`LoadingPlan.peak`): the trained component's
    terms (`_trained_terms`), or the largest frozen component passing through when that is more. Frozen
    components converted to another dtype are held (on the CPU) or pass through (on a GPU).
    """
    from glm_training.models.placement import parse_dtype

    m = cfg.model
    shard = shard_count(cfg, world_size, strategy or cfg.trainer.strategy)
    into_shards = shard > 1 and cfg.trainer.fsdp_load_into_shards
    modules = modules if modules is not None else meta_components(m)
    dtype, wbytes = parse_dtype(m.dtype), DTYPE_BYTES[m.dtype]
    half = model_half(cfg.component)
    ld = _Loading(cfg, shard, into_shards, device == "cpu", dtype, wbytes, _weights_folder(m))
    if into_shards:
        way = f"read into 1/{shard} shards"
    else:
        way = "whole on every rank" + (", then sharded" if shard > 1 else "")
    plan = LoadingPlan(way, device)
    plan.terms.append(Term("libraries, configs, tokenizers", LOADING_OVERHEAD_BYTES, "measured, rounded up"))
    converted, passing = _frozen(ld, modules, half)
    if converted:
        plan.terms.append(Term("frozen components (converted)", converted, f"into {m.dtype}, on the CPU"))
    trained_terms = _trained_terms(ld, modules[half.attribute], half)
    trained_bytes = sum(t.bytes for t in trained_terms)
    if passing > trained_bytes:  # the frozen components' moment is the peak
        plan.terms.append(Term("frozen component passing through", passing, "the largest one's file pages"))
    else:
        plan.terms += trained_terms
    return plan

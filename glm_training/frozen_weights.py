"""Trained weights for the *frozen* half of GLM-Image: chaining the two decoupled post-training stages.

GLM-Image's makers post-trained the AR model (low-frequency rewards) and the DiT decoder (high-frequency
rewards) separately. To chain the stages, a run can freeze the other half at the weights another run trained:

* `model.ar_weights`: the AR model the DiT trainer (live priors) and `python -m glm_training.priors` sample
  prior tokens with;
* `model.dit_weights`: the DiT the AR trainer renders its samples with.

Each takes an AR/DiT run folder (its newest checkpoint), a checkpoint step folder (LoRA or full fine-tuning)
or an export folder (`python -m glm_training.export`). Checkpoints go through the readers the export uses
(`checkpoint.read_checkpoint`, `export.load_trained_weights`, peft's merge), so a chained run sees exactly the
weights an export of that checkpoint would hold.

`component_fingerprint` names the weights a component would be loaded with, from the files alone (no model
is built): the prior cache records it for the AR model and a DiT run compares it before loading anything.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm_training.checkpoint import SHARDS_DIR, WEIGHTS_FILE, CheckpointError, CheckpointInfo, read_checkpoint
from glm_training.config import ConfigError
from glm_training.export import inspect_checkpoints, load_trained_weights
from glm_training.models.halves import HALVES
from glm_training.models.lora import merge_lora_adapters
from glm_training.models.wrapper import model_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightsSource:
    """Where the trained weights of one frozen component come from (checked, nothing loaded)."""

    component: str  # "ar" or "dit"
    kind: str  # "checkpoint" or "export"
    path: Path  # the checkpoint step folder, or the export's component subfolder
    info: CheckpointInfo | None  # checkpoints only

    @property
    def key(self) -> str:
        return HALVES[self.component].weights_key

    @property
    def pipeline_component(self) -> str:
        return HALVES[self.component].attribute

    def describe(self) -> str:
        if self.info is not None:
            kind = "LoRA" if self.info.is_lora else "full fine-tuning"
            return f"{self.key}: {self.component} checkpoint step {self.info.step} ({kind}) {self.path}"
        return f"{self.key}: exported {self.pipeline_component} {self.path}"


def _spec(model_cfg: Any, component: str) -> str:
    return str(getattr(model_cfg, HALVES[component].weights_key.split(".")[1], "") or "")


def resolve_weights_source(model_cfg: Any, component: str) -> WeightsSource | None:
    """`model.ar_weights` / `model.dit_weights` checked against `model.name`; None when unset.

    Raises `ConfigError` naming the key for a folder that is neither a checkpoint of that component nor an
    export, and for a checkpoint trained from another base model.
    """
    key, spec = HALVES[component].weights_key, _spec(model_cfg, component)
    if not spec:
        return None
    path = Path(spec).expanduser()
    sub = HALVES[component].attribute
    if (path / "model_index.json").is_file():
        if not (path / sub / "config.json").is_file():
            raise ConfigError(
                key, f"'{spec}' is a pipeline folder without a {sub}/ folder to take weights from."
            )
        return WeightsSource(component, "export", path / sub, None)
    try:
        info = read_checkpoint(path)
        inspect_checkpoints([info.path])
    except CheckpointError as err:
        raise ConfigError(key, f"'{spec}' is not usable: {err}") from None
    if info.component != component:
        raise ConfigError(
            key,
            f"'{spec}' holds a {info.component} checkpoint ({info.pipeline_component}); {key} takes a "
            f"{component} run, checkpoint or export.",
        )
    base, theirs = model_cfg.base_model_id(), info.model.base_model_id()
    if base != theirs:
        raise ConfigError(
            key,
            f"'{spec}' was trained from base model {theirs}, this run loads {base}; set model.name (and "
            "model.tiny_seed, model.shape_num_*_layers) to the checkpoint's, or export it first and give the "
            "export folder.",
        )
    return WeightsSource(component, "checkpoint", info.path, info)


def frozen_weight_sources(
    model_cfg: Any, trained_component: str, skip: tuple[str, ...] = ()
) -> list[WeightsSource]:
    """The checked weight sources of every frozen, loaded component; errors before any model loads."""
    sources = []
    for component in HALVES:
        if not _spec(model_cfg, component):
            continue
        if component == trained_component:
            raise ConfigError(
                HALVES[component].weights_key,
                f"sets the weights of the frozen {component} half, but this run trains the {component}; "
                "continue a run with trainer.resume, or leave it empty.",
            )
        if HALVES[component].attribute in skip:
            continue  # not loaded at all (e.g. the AR model of a cached-prior DiT run)
        sources.append(resolve_weights_source(model_cfg, component))
    return sources


@torch.no_grad()
def apply_weights_source(pipeline: Any, source: WeightsSource) -> None:
    """Put the trained weights into the pipeline's (already placed) frozen component, in place.

    Checkpoints: the trainers' LoRA adapters are added and merged (peft's merge, as the export does), or the
    full weights copied. Exports: the component is read with its own class's `from_pretrained` on CPU and its
    state copied into the live module, which keeps the module's device and dtype.
    """
    module = getattr(pipeline, source.pipeline_component)
    if source.info is not None:
        load_trained_weights(module, source.info)
        if source.info.is_lora:
            merge_lora_adapters(module)
    else:
        dtype = next(module.parameters()).dtype
        loaded = type(module).from_pretrained(source.path, torch_dtype=dtype)
        result = module.load_state_dict(loaded.state_dict(), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ConfigError(
                source.key,
                f"'{source.path}' does not match the base model's {source.pipeline_component}: missing "
                f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}.",
            )
        del loaded
    module.requires_grad_(False).eval()
    logger.info("[load] %s <- %s", source.pipeline_component, source.describe())


# ---------------------------------------------------------------------------------------------------------
# Fingerprints


def apply_chained_weights(pipeline: Any, cfg: Any, given: list[str]) -> None:
    """The run's `model.ar_weights` / `model.dit_weights` for the halves no `--checkpoint` supplies.

    A DiT run chained to a trained AR model (and trained on priors cached from it) is evaluated with that AR
    model: its live tokens are the cached ones, so the numbers equal the training-time evaluation's.
    """
    for component in HALVES:
        if component in given or component == cfg.component:
            continue
        source = resolve_weights_source(cfg.model, component)
        if source is not None:
            apply_weights_source(pipeline, source)


def _file_digest(path: Path) -> str:
    """sha256 of a file; for a Hugging Face cache snapshot link, the blob's name (already its sha256)."""
    if path.is_symlink():
        target = Path(path.resolve())
        if target.parent.name == "blobs" and len(target.name) == 64:
            return target.name
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def folder_digest(folder: Path) -> str:
    """sha256 over (relative name, content digest) of every file in `folder`, in name order."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    for path in files:
        h.update(f"{path.relative_to(folder).as_posix()}\0{_file_digest(path)}\n".encode())
    return h.hexdigest()


def _base_folder(model_cfg: Any, component: str) -> Path:
    """The local folder of the base pipeline, fetching only `model_index.json` of a hub id if needed."""
    path = Path(model_path(model_cfg))
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), allow_patterns=["model_index.json"]))


def component_fingerprint(model_cfg: Any, component: str) -> tuple[str, dict[str, Any]]:
    """(sha256 hex, readable description) of the weights `component` would be loaded with, model-free.

    The base component's files (and its companions, the processor for the AR model) are hashed; a hub
    snapshot contributes its blob names, which are sha256s already, so an 18 GB AR model is never read for
    it. `model.ar_weights` / `model.dit_weights` add the checkpoint's trained weights and LoRA settings, or
    the export's component folder in place of the base one.
    """
    base = _base_folder(model_cfg, component)
    sub = HALVES[component].attribute
    source = resolve_weights_source(model_cfg, component)
    parts: dict[str, Any] = {"base_model": model_cfg.name}
    if model_cfg.name == "tiny":
        parts["tiny_seed"] = model_cfg.tiny_seed
    weights_folder = source.path if source is not None and source.kind == "export" else base / sub
    if weights_folder.is_dir():
        parts[sub] = folder_digest(weights_folder)
    else:  # a hub snapshot without the weights downloaded: its commit names every file
        parts[sub] = f"hub:{model_cfg.name}@{base.name}"
    for companion in HALVES[component].companion_folders:
        if (base / companion).is_dir():
            parts[companion] = folder_digest(base / companion)
    if source is not None:
        parts["weights"] = source.describe()
        if source.info is not None:
            shards = source.info.path / SHARDS_DIR
            parts["trained_weights"] = (
                folder_digest(shards) if shards.is_dir() else _file_digest(source.info.path / WEIGHTS_FILE)
            )
            lora = source.info.model.lora
            parts["lora"] = (
                {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
                if lora.enabled
                else None
            )
    # Only contents count: the same weights under another path or model name give the same fingerprint.
    descriptive = ("base_model", "tiny_seed", "weights")
    digest = hashlib.sha256(
        json.dumps({k: v for k, v in parts.items() if k not in descriptive}, sort_keys=True).encode()
    ).hexdigest()
    return digest, parts

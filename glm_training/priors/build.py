"""Building a prior cache: sample each shard's rows with the pipeline's AR stage, write, then the manifest.

Ranks share the shards round-robin; a rerun skips the shards that exist.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from glm_training.pipeline.dit import generate_prior_tokens
from glm_training.priors.format import (
    MANIFEST_FILE,
    PLAN_FILE,
    SHARD_DIR,
    SPLITS,
    TOKENS,
    VERSION,
    PriorCacheError,
    Shard,
    _differences,
    _plan_record,
    _sha256,
    _write_json_atomic,
    cache_settings,
    plan_shards,
    unique_texts,
)

logger = logging.getLogger("glm_training")


def generate_shard(pipeline: Any, shard: Shard) -> torch.Tensor:
    """[len(texts) x rows, L] int32 tokens, one AR call per (prompt, row) as the trainer's live path makes
    them for one prompt: a row depends on its own seed only."""
    rows = [
        generate_prior_tokens(pipeline, [text], shard.height, shard.width, seed=seed)
        for text, seeds in zip(shard.texts, shard.seeds)
        for seed in seeds
    ]
    return torch.cat(rows).to(torch.int32)


def write_shard(folder: Path, shard: Shard, tokens: torch.Tensor, tag: str = "") -> Path:
    """Write a shard's tokens under a temporary name, then rename: a shard file that exists is complete."""
    from safetensors.torch import save_file

    expected = len(shard.texts) * shard.rows
    if tokens.shape[0] != expected:
        raise ValueError(f"shard {shard.name}: {tokens.shape[0]} rows for {expected} expected")
    final = Path(folder) / SHARD_DIR / shard.name
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{tag or os.getpid()}.tmp")
    # One key: safetensors writes a metadata map in hash order, and a shard's bytes must not depend on it.
    info = {"split": shard.split, "rows_per_prompt": shard.rows, "texts": shard.texts}
    metadata = {"shard": json.dumps(info, sort_keys=True)}
    save_file({TOKENS: tokens.to(torch.int32).contiguous()}, str(tmp), metadata=metadata)
    os.replace(tmp, final)
    return final


def finish_manifest(folder: Path, settings: dict, shards: list[Shard]) -> Path:
    """Check every shard and write `manifest.json` last, atomically: from then on the cache is finished."""
    from safetensors import safe_open

    folder = Path(folder)
    records, index = [], {split: {} for split in SPLITS}
    for shard in shards:
        path = folder / SHARD_DIR / shard.name
        with safe_open(str(path), "pt") as f:
            shape = f.get_slice(TOKENS).get_shape()
        if shape[0] != len(shard.texts) * shard.rows:
            raise PriorCacheError(
                f"shard {path} holds {shape[0]} rows, expected {len(shard.texts) * shard.rows}"
            )
        records.append(
            {
                "file": shard.name,
                "split": shard.split,
                "num_rows": shape[0],
                "length": shape[1],
                "sha256": _sha256(path),
            }
        )
        for i, text in enumerate(shard.texts):
            index[shard.split][text] = {"shard": shard.name, "rows": [i * shard.rows, (i + 1) * shard.rows]}
    manifest = {"version": VERSION, "settings": settings, "shards": records, **index}
    path = folder / MANIFEST_FILE
    _write_json_atomic(path, manifest)
    return path


def build_cache(
    cfg: Any, output: Path, *, num_priors: int = 4, seed: int | None = None, shard_size: int = 16
) -> Path:
    """Sample the cache of `cfg` (a DiT training config) into `output`; see the module docstring."""
    from glm_training.data import load_prompts
    from glm_training.distributed import collectives as dist
    from glm_training.evaluation import load_eval_prompts
    from glm_training.frozen_weights import component_fingerprint

    if getattr(cfg, "component", "dit") != "dit":
        raise PriorCacheError(
            "--config must be a DiT training config (train_dit.py's, e.g. configs/t2i_training.yaml): the "
            "cache holds the prior tokens a DiT run decodes, at its sampling.height/width."
        )
    if num_priors < 1 or shard_size < 1:
        raise PriorCacheError("--num-priors-per-prompt and --shard-size must be >= 1.")
    output = Path(output).expanduser()
    if (output / MANIFEST_FILE).is_file():
        raise PriorCacheError(
            f"'{output}' already holds a finished prior cache ({MANIFEST_FILE}); a cache is never "
            "overwritten. Choose another --output, or delete that folder yourself."
        )
    if output.exists() and not output.is_dir():
        raise PriorCacheError(f"--output '{output}' exists and is not a folder.")
    train = unique_texts(load_prompts(cfg.data.resolved_prompt_file()))
    evaluation = unique_texts(load_eval_prompts(cfg.eval))

    accelerator = dist.make_accelerator(timeout_s=cfg.trainer.dist_timeout_s)
    rank, world = accelerator.process_index, accelerator.num_processes
    with accelerator.main_process_first():  # rank 0 builds the tiny model once
        fingerprint, weights = component_fingerprint(cfg.model, "ar")
    seed = cfg.trainer.seed if seed is None else seed
    settings = cache_settings(cfg, num_priors=num_priors, seed=seed, fingerprint=fingerprint, weights=weights)
    shards = plan_shards(train, evaluation, settings, shard_size)
    plan = _plan_record(settings, shards)
    plan_path = output / PLAN_FILE
    if plan_path.is_file():
        before = json.loads(plan_path.read_text(encoding="utf-8"))
        diff = _differences(before, plan)
        if diff:
            raise PriorCacheError(
                f"'{output}' holds an unfinished cache made with other settings ({'; '.join(diff[:4])}); "
                "rerun with the same settings to finish it, or choose another --output."
            )
    dist.barrier()
    if accelerator.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(plan_path, plan)
    dist.barrier()

    mine = [s for i, s in enumerate(shards) if i % world == rank]
    todo = [s for s in mine if not (output / SHARD_DIR / s.name).is_file()]
    logger.info(
        "prior cache %s: %d shards (%d train prompts x %d, %d eval prompts); rank %d: %d to do, %d done",
        output,
        len(shards),
        len(train),
        num_priors,
        len(evaluation),
        rank,
        len(todo),
        len(mine) - len(todo),
    )
    if todo:
        pipeline = load_ar_pipeline(cfg.model, dist.choose_device(accelerator.local_process_index))
        for shard in todo:
            write_shard(output, shard, generate_shard(pipeline, shard), tag=f"rank{rank}")
            logger.info("wrote %s", shard.name)
    dist.barrier()
    if accelerator.is_main_process:
        finish_manifest(output, settings, shards)
    dist.barrier()
    return output


def load_ar_pipeline(model_cfg: Any, device: torch.device) -> Any:
    """The pipeline with only what the AR stage uses (processor, AR model, with `model.ar_weights`)."""
    from diffusers import GlmImagePipeline

    from glm_training.frozen_weights import apply_weights_source, resolve_weights_source
    from glm_training.models.placement import parse_dtype
    from glm_training.models.wrapper import model_path

    path = model_path(model_cfg)
    skipped = dict.fromkeys(("text_encoder", "transformer", "vae", "tokenizer"))
    pipeline = GlmImagePipeline.from_pretrained(path, dtype=parse_dtype(model_cfg.dtype), **skipped)
    ar = pipeline.vision_language_encoder
    if ar.generation_config.pad_token_id is None:
        ar.generation_config.pad_token_id = ar.generation_config.eos_token_id
    source = resolve_weights_source(model_cfg, "ar")
    if source is not None:
        apply_weights_source(pipeline, source)
    ar.requires_grad_(False).eval().to(device)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline

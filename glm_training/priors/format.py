"""The prior cache's format: file names, seeds, which row a group decodes, the shard plan and its settings.

The layout is described in `glm_training/priors/__init__.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm_training.errors import UserError
from glm_training.pipeline.dit import prompt_seed

VERSION = 1
MANIFEST_FILE = "manifest.json"
PLAN_FILE = "plan.json"
SHARD_DIR = "shards"
TOKENS = "tokens"
SPLITS = ("train", "eval")


class PriorCacheError(UserError, ValueError):
    """A prior cache cannot be built or used as asked; the message names the mismatch and the remedy."""


def row_seed(seed: int, text: str, row: int) -> int:
    """Seed of cached row `row` of prompt `text`: a function of (seed, text, row), not of rank or batch."""
    return prompt_seed(seed * 10_007 + row, text)


def choose_row(seed: int, step: int, group: int, text: str, num_rows: int) -> int:
    """Which cached row group `group` (prompt `text`) decodes at `step`; the group index keeps two groups of
    one prompt in a step apart, as live sampling would."""
    rng = np.random.default_rng([seed, step, group, zlib.crc32(text.encode("utf-8"))])
    return int(rng.integers(num_rows))


def unique_texts(prompts: Sequence[Any]) -> list[str]:
    """Prompt texts in file order without repeats (a JSONL file may repeat a prompt with other metadata)."""
    return list(dict.fromkeys(p.text for p in prompts))


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class Shard:
    """A unit of work and a file: consecutive prompts of one split, each with `rows` sequences."""

    split: str
    index: int
    texts: tuple[str, ...]
    seeds: tuple[tuple[int, ...], ...]  # per text, one seed per row
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:05d}.safetensors"

    @property
    def rows(self) -> int:
        return len(self.seeds[0])


def cache_settings(cfg: Any, *, num_priors: int, seed: int, fingerprint: str, weights: dict) -> dict:
    """What the cache's tokens depend on, as recorded in `plan.json` and `manifest.json`."""
    from glm_training.evaluation import eval_sampling

    ev = eval_sampling(cfg)
    return {
        "version": VERSION,
        "height": cfg.sampling.height,
        "width": cfg.sampling.width,
        "num_priors_per_prompt": num_priors,
        "seed": seed,
        "eval": {"height": ev.height, "width": ev.width, "seed": ev.seed},
        "sampling": ar_sampling_parameters(cfg.model),
        "dtype": cfg.model.dtype,
        "ar_fingerprint": fingerprint,
        "ar_weights": weights,
    }


def ar_sampling_parameters(model_cfg: Any) -> dict:
    """The AR generation settings the pipeline samples with (its `generation_config.json`, do_sample on)."""
    from glm_training.frozen_weights import resolve_weights_source
    from glm_training.models.wrapper import model_path

    source = resolve_weights_source(model_cfg, "ar")
    folder = (
        source.path
        if source is not None and source.kind == "export"
        else Path(model_path(model_cfg)) / "vision_language_encoder"
    )
    path = folder / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    keys = ("temperature", "top_p", "top_k", "max_new_tokens", "eos_token_id", "pad_token_id")
    return {"do_sample": True, **{k: config[k] for k in keys if k in config}}


def plan_shards(train: list[str], evaluation: list[str], settings: dict, shard_size: int) -> list[Shard]:
    """Every shard of the cache, in a fixed order (the same for any number of ranks)."""
    shards = []
    ev = settings["eval"]
    for split, texts in (("train", train), ("eval", evaluation)):
        for index, start in enumerate(range(0, len(texts), shard_size)):
            chunk = tuple(texts[start : start + shard_size])
            if split == "train":
                seeds = tuple(
                    tuple(row_seed(settings["seed"], t, r) for r in range(settings["num_priors_per_prompt"]))
                    for t in chunk
                )
                size = (settings["height"], settings["width"])
            else:  # the evaluation's own seed, so the cached tokens are the ones it would sample
                seeds = tuple((prompt_seed(ev["seed"], t),) for t in chunk)
                size = (ev["height"], ev["width"])
            shards.append(Shard(split, index, chunk, seeds, *size))
    return shards


def _plan_record(settings: dict, shards: list[Shard]) -> dict:
    texts = hashlib.sha256(json.dumps([[s.name, s.texts] for s in shards]).encode()).hexdigest()
    return {"settings": settings, "shards": [s.name for s in shards], "prompts_sha256": texts}


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} vs {b!r}"]

"""A cache of AR prior tokens, so the DiT trains (Flow-GRPO) without the AR model loaded.

GLM-Image is post-trained in two decoupled stages: the AR model with low-frequency rewards, the DiT decoder
with high-frequency ones. While the DiT trains, the AR model only writes each prompt's prior tokens, and on
the real model that is most of a sample's time and ~18 GB of weights on every GPU. The cache samples those
tokens once, ahead of training:

    python -m glm_training.priors --config configs/t2i_training.yaml --output priors/base \
        [--num-priors-per-prompt 4] [--seed N] [key=value ...]
    torchrun --nproc_per_node=8 -m glm_training.priors --config ... --output ...   # split over ranks
    python train_dit.py data.prior_cache=priors/base ...                           # no AR model loaded

For every prompt of `data.prompt_file` it keeps `num_priors_per_prompt` token sequences, row r sampled by
the pipeline's own AR stage (`rollout.dit.generate_prior_tokens`, one prompt per call) from the seed
`row_seed(seed, prompt, r)`; for every held-out prompt (`eval.*`) one sequence, sampled from exactly the seed
the evaluation uses (`prompt_seed(eval.seed, prompt)`), so a cached evaluation equals a live one. Tokens are
at the config's resolution (`sampling.height/width`, `eval.height/width`) with the AR model the config names
(`model.name`, `model.ar_weights`) and its generation settings.

Layout of the output folder:

* `shards/<split>-NNNNN.safetensors`: one tensor `tokens` [num_prompts x rows, L] (int32), prompts in order;
  each is written to a temporary name and renamed, so a shard that exists is complete. Shards are dealt
  round-robin to the ranks; a rerun skips the shards that exist (resume after a crash).
* `plan.json`: the settings the shards are being made with; a rerun with other settings is refused.
* `manifest.json`, written last (rank 0, atomically): the settings (resolution, sampling parameters, seeds,
  the AR weights' fingerprint from `models.frozen_weights.component_fingerprint`), each shard's sha256, and
  prompt text -> (shard, rows). A folder with a manifest is a finished cache and is never written again.

In training (`data.prior_cache=DIR`) the group of prompt p at step s decodes row
`choose_row(trainer.seed, s, g, p)`: a pure function, so a resumed run reads what the uninterrupted one did.
`open_for_dit_run` refuses, before the DiT loads, a cache made at another resolution, by other AR weights,
without some of the run's prompts, or whose files do not match their sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glm_training.errors import UserError
from glm_training.rollout.dit import generate_prior_tokens, prompt_seed

logger = logging.getLogger("glm_training")

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
    from glm_training.evaluate import eval_sampling

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
    from glm_training.models.frozen_weights import resolve_weights_source
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


# ---------------------------------------------------------------------------------------------------------
# Build


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
    from glm_training import distributed as dist
    from glm_training.data import load_prompts
    from glm_training.evaluate import load_eval_prompts
    from glm_training.models.frozen_weights import component_fingerprint

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

    from glm_training.models.frozen_weights import apply_weights_source, resolve_weights_source
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


# ---------------------------------------------------------------------------------------------------------
# Read


class PriorCache:
    """A finished cache, checked against its manifest's sha256s on opening; rows are read lazily."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder).expanduser()
        key = "data.prior_cache"
        if not self.folder.is_dir():
            raise PriorCacheError(
                f"{key}='{folder}' does not exist; build it with python -m glm_training.priors --config "
                "<dit config> --output DIR."
            )
        path = self.folder / MANIFEST_FILE
        if not path.is_file():
            unfinished = (
                " (an unfinished build: rerun the same command to finish it)"
                if (self.folder / PLAN_FILE).is_file()
                else ""
            )
            raise PriorCacheError(
                f"{key}='{folder}' is not a finished prior cache: no {MANIFEST_FILE}{unfinished}; build it "
                "with python -m glm_training.priors."
            )
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            self.settings = manifest["settings"]
            self.shards = {r["file"]: r for r in manifest["shards"]}
            self.index = {split: manifest[split] for split in SPLITS}
        except (ValueError, KeyError, TypeError) as err:
            raise PriorCacheError(
                f"{key}='{folder}': {MANIFEST_FILE} is corrupted ({err!r}); rebuild the cache."
            ) from None
        if manifest.get("version") != VERSION:
            raise PriorCacheError(
                f"{key}='{folder}' has cache format {manifest.get('version')}, this version reads "
                f"{VERSION}; rebuild it."
            )
        for name, record in self.shards.items():
            shard = self.folder / SHARD_DIR / name
            if not shard.is_file():
                raise PriorCacheError(
                    f"{key}='{folder}' is corrupted: shard {name} is missing; rebuild the cache."
                )
            if _sha256(shard) != record["sha256"]:
                raise PriorCacheError(
                    f"{key}='{folder}' is corrupted: shard {name} does not match its sha256 in "
                    f"{MANIFEST_FILE}; rebuild the cache."
                )
        self._files: dict[str, Any] = {}

    @property
    def num_rows(self) -> int:
        return int(self.settings["num_priors_per_prompt"])

    def check(
        self,
        *,
        height: int,
        width: int,
        fingerprint: str,
        train_texts: list[str],
        eval_texts: list[str],
        eval_sampling: Any | None,
    ) -> None:
        """Refuse a cache that does not fit the run; the first mismatch is named with its remedy."""
        s, where = self.settings, f"data.prior_cache='{self.folder}'"
        rebuild = "rebuild it with python -m glm_training.priors and this run's config"
        if (s["height"], s["width"]) != (height, width):
            raise PriorCacheError(
                f"{where} holds priors for {s['height']}x{s['width']} images, this run samples "
                f"sampling.height x width = {height}x{width}; {rebuild}."
            )
        made_by = s["ar_weights"].get("weights") or f"base model {s['ar_weights'].get('base_model')}"
        if s["ar_fingerprint"] != fingerprint:
            raise PriorCacheError(
                f"{where} was made by other AR weights ({made_by}, fingerprint "
                f"{s['ar_fingerprint'][:12]}) than this run's model.name / model.ar_weights (fingerprint "
                f"{fingerprint[:12]}); {rebuild}, or set model.ar_weights to the AR run it was made with."
            )
        self._check_prompts("train", train_texts, "training prompts of data.prompt_file", rebuild)
        if eval_sampling is not None:
            ev = s["eval"]
            got = {"height": eval_sampling.height, "width": eval_sampling.width, "seed": eval_sampling.seed}
            diff = [
                f"eval.{k}: cache {ev[k]} vs run {got[k]}"
                for k in ("height", "width", "seed")
                if ev[k] != got[k]
            ]
            if diff:
                raise PriorCacheError(
                    f"{where} holds evaluation priors made with other settings ({'; '.join(diff)}); "
                    f"{rebuild}."
                )
            self._check_prompts("eval", eval_texts, "evaluation prompts", rebuild)

    def _check_prompts(self, split: str, texts: list[str], what: str, remedy: str) -> None:
        missing = [t for t in texts if t not in self.index[split]]
        if missing:
            raise PriorCacheError(
                f"data.prior_cache='{self.folder}' lacks {len(missing)} of the {len(texts)} {what}, e.g. "
                f"{missing[0]!r}; {remedy}."
            )

    def _rows(self, split: str, text: str) -> tuple[Any, int, int]:
        entry = self.index[split][text]
        name = entry["shard"]
        if name not in self._files:
            from safetensors import safe_open

            self._files[name] = safe_open(str(self.folder / SHARD_DIR / name), "pt")
        return self._files[name].get_slice(TOKENS), *entry["rows"]

    def tokens(self, split: str, text: str, row: int) -> torch.Tensor:
        """[L] int64 prior tokens, row `row` of prompt `text` in split "train" or "eval"."""
        rows, start, end = self._rows(split, text)
        if not 0 <= row < end - start:
            raise IndexError(f"row {row} of {end - start}")
        return rows[start + row : start + row + 1][0].to(torch.int64)

    def step_tokens(self, texts: Sequence[str], seed: int, step: int) -> torch.Tensor:
        """[G, L] the rows the step's groups decode (`choose_row`); identical on every rank."""
        return torch.stack(
            [
                self.tokens("train", t, choose_row(seed, step, g, t, self.num_rows))
                for g, t in enumerate(texts)
            ]
        )

    def eval_tokens(self, texts: Sequence[str]) -> torch.Tensor:
        """[B, L] the held-out prompts' tokens, as the evaluation would sample them live."""
        return torch.stack([self.tokens("eval", t, 0) for t in texts])


def open_for_dit_run(cfg: Any, prompts: Sequence[Any], eval_prompts: Sequence[Any]) -> PriorCache | None:
    """The run's checked cache (`data.prior_cache`), or None; every refusal comes before a model loads."""
    if not cfg.data.prior_cache:
        return None
    from glm_training.evaluate import eval_sampling
    from glm_training.models.frozen_weights import component_fingerprint

    cache = PriorCache(cfg.data.prior_cache)
    fingerprint, _ = component_fingerprint(cfg.model, "ar")
    cache.check(
        height=cfg.sampling.height,
        width=cfg.sampling.width,
        fingerprint=fingerprint,
        train_texts=unique_texts(prompts),
        eval_texts=unique_texts(eval_prompts),
        eval_sampling=eval_sampling(cfg) if eval_prompts else None,
    )
    logger.info(
        "prior tokens from the cache %s (%d per prompt); the AR model is not loaded",
        cache.folder,
        cache.num_rows,
    )
    return cache


# ---------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.priors",
        description="Sample the AR prior tokens of a DiT run's prompts once, for data.prior_cache.",
    )
    parser.add_argument(
        "--config", required=True, help="the DiT training config (e.g. configs/t2i_training.yaml)"
    )
    parser.add_argument("--output", required=True, type=Path, help="the cache folder (never overwritten)")
    parser.add_argument("--num-priors-per-prompt", type=int, default=4, help="sequences per training prompt")
    parser.add_argument(
        "--seed", type=int, default=None, help="base seed of the rows (default: trainer.seed)"
    )
    parser.add_argument("--shard-size", type=int, default=16, help="prompts per shard file (the resume unit)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s) {unknown}; config overrides are key=value, e.g. sampling.height=64")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from glm_training.errors import report_user_errors

    def body() -> str:
        from glm_training.config import load_config
        from glm_training.logs import setup_logging

        args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        setup_logging(int(os.environ.get("RANK", "0")) == 0)
        cfg = load_config(["--config", args.config, *overrides], args.config)
        out = build_cache(
            cfg,
            args.output,
            num_priors=args.num_priors_per_prompt,
            seed=args.seed,
            shard_size=args.shard_size,
        )
        return f"done: prior cache in {out}"

    return report_user_errors(body)


if __name__ == "__main__":
    raise SystemExit(main())

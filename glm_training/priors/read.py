"""Reading a finished prior cache in training (`data.prior_cache`), checked before the DiT loads."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from glm_training.priors.format import (
    MANIFEST_FILE,
    PLAN_FILE,
    SHARD_DIR,
    SPLITS,
    TOKENS,
    VERSION,
    PriorCacheError,
    _sha256,
    choose_row,
    unique_texts,
)

logger = logging.getLogger("glm_training")


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

    def initial_latents(self) -> None:
        """The rollout draws its own initial noise (`priors.source.PriorSource`)."""
        return None


def open_for_dit_run(cfg: Any, prompts: Sequence[Any], eval_prompts: Sequence[Any]) -> PriorCache | None:
    """The run's checked cache (`data.prior_cache`), or None; every refusal comes before a model loads."""
    if not cfg.data.prior_cache:
        return None
    from glm_training.evaluation import eval_sampling
    from glm_training.frozen_weights import component_fingerprint

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

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
the pipeline's own AR stage (`pipeline.dit.generate_prior_tokens`, one prompt per call) from the seed
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

Modules: `format.py` (file names, seeds, the shard plan), `build.py` (the writer), `read.py` (`PriorCache`,
`open_for_dit_run`), `__main__.py` (the command line).
"""

from __future__ import annotations

from glm_training.priors.build import (
    build_cache,
    finish_manifest,
    generate_shard,
    load_ar_pipeline,
    write_shard,
)
from glm_training.priors.cli import main, parse_args
from glm_training.priors.format import (
    MANIFEST_FILE,
    PLAN_FILE,
    SHARD_DIR,
    SPLITS,
    TOKENS,
    VERSION,
    PriorCacheError,
    Shard,
    ar_sampling_parameters,
    cache_settings,
    choose_row,
    plan_shards,
    row_seed,
    unique_texts,
)
from glm_training.priors.read import PriorCache, open_for_dit_run

__all__ = [
    "MANIFEST_FILE",
    "PLAN_FILE",
    "PriorCache",
    "PriorCacheError",
    "SHARD_DIR",
    "SPLITS",
    "Shard",
    "TOKENS",
    "VERSION",
    "ar_sampling_parameters",
    "build_cache",
    "cache_settings",
    "choose_row",
    "finish_manifest",
    "generate_shard",
    "load_ar_pipeline",
    "main",
    "open_for_dit_run",
    "parse_args",
    "plan_shards",
    "row_seed",
    "unique_texts",
    "write_shard",
]

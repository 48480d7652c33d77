"""One-command check of the GPU path: speed, memory and placement of GLM-Image at its real depth.

    python -m glm_training.gpu_check [--device cuda|cpu] [--toy] [--output DIR] [--sections NAME ...]

Made for one 80 GB GPU: all the sections take about 9 minutes (the recipes 3.5 of them; docs/benchmarks.md).
It downloads nothing and writes, under `--output`, `gpu_check.jsonl` (one line per finished stage, flushed and
synced at once, so that a run stopped at a time limit keeps every finished stage), `gpu_check.json`
(everything) and `gpu_check.md` (the tables for docs/benchmarks.md, targets first); a temporary folder it
removes holds a 1 MB tiny GLM-Image for the seed checks and the trainers' config and metrics files. It exits 1
when a check fails or a stage raises. After the environment (device, driver, versions, measured copy bandwidth
and matmul throughput), the sections in order of value (`SECTIONS`; `--sections` picks some):

1. `seeds`: the lessons of the project's four seed bugs, checked on the device through the project's own code
   (`models/placement.py`, `models/wrapper.py`, `distributed/collectives.py`) on the tiny model;
2. then GLM-Image is built at the real depth (40 AR layers, 40 vision layers, 30 DiT blocks, 12 glyph
   layers; the widths of `models/shape.py`) with random weights directly on the device: each component is
   created on the meta device, materialised with `to_empty` and filled by a seeded deterministic init (no
   round trip through disk); a forward of the AR model must give finite logits;
3. `dit`: one Flow-GRPO LoRA step of the DiT (`recipes/flow_grpo_fast_ocr`): seconds, MFU, peak
   memory next to `glm_training.plan`'s prediction; its prior tokens are seeded random codebook ids, as a
   prior cache (`data.prior_cache`) hands them over, so the step times the DiT alone;
4. `ar`: one GRPO/DAPO LoRA step of the AR model (`recipes/dapo_aesthetic_alignment`): seconds
   and peak memory next to the plan;
5. `recipes`: images per GPU-second of each recipe (`settings.default_recipes`, or those `--recipes` names,
   each optionally with `:key=value` overrides): one step of the recipe's own algorithm and settings on a
   group of its micro-batch (two steps, the second timed, for the AR recipes);
6. `decoding`: AR decoding tokens/s over a fixed number of steps (`pipeline.ar.decode_first_tokens`) at each
   batch size, for every path in `DECODING_PATHS` (or those `--decoding` names) and, with `--compile`
   (default on CUDA), the loop's compiled step (CUDA graphs), next to the memory-bandwidth roofline;
7. `pipeline`: one text-to-image call at each size: the project's decoding loop (compiled where it compiled
   in 5) writes the prior tokens, the pipeline's DiT and VAE turn them into pixels.

`--profile SECTION ...` runs the training steps (`dit`, `ar`) or one more warm call of the compiled decoding
loop (`decoding`) under `torch.profiler` and writes its kernel table as `profile_<section>.txt`;
`--packed-attention` times the decoding loop with the folded sampler's attention (`pipeline/ar_attention.py`).

`--toy` keeps one layer per stack (the real widths: the `model=glm_image_shape` fixture's layout) and 64x64
images, so the same code runs on a CPU (in float32 where the CPU has no native bf16).

The modules, one concept each:

- `settings`: `Settings`, the command line (`parse_settings`), `SECTIONS`, the prompt;
- `measure`: timing and peak memory, the environment, copy bandwidth and matmul throughput;
- `build`: the model built on the device with random weights (how the weights are made), its logits check;
- `seeds`: the four seed checks;
- `training`: the training steps through the project's trainers around the in-memory pipeline;
- `recipes`: which step each recipe's row trains, and its images per GPU-second;
- `decoding`: AR decoding speed against its roofline, the text-to-image call;
- `report`: the stages and the files they land in; `markdown`: the tables and the targets;
- `cli`: `main`, the run stage by stage (`__main__` calls it).
"""

from __future__ import annotations

from glm_training.gpu_check.build import ar_logits_check, build_pipeline, numel
from glm_training.gpu_check.cli import main, run_decoding, run_text_to_image
from glm_training.gpu_check.decoding import decode_bytes_per_step, time_decoding, time_text_to_image
from glm_training.gpu_check.markdown import render_markdown, target_rows
from glm_training.gpu_check.measure import (
    GIB,
    PACKAGES,
    SPEC_BF16_FLOPS,
    environment,
    measure_bandwidth,
    measure_matmul,
    measured,
    spec_peak_flops,
    synchronize,
)
from glm_training.gpu_check.report import Report
from glm_training.gpu_check.seeds import counting_moves, run_checks
from glm_training.gpu_check.settings import PROMPT, SECTIONS, Settings, parse_settings
from glm_training.gpu_check.training import (
    COMMON_OVERRIDES,
    RandomPriors,
    dit_update_flops,
    train_step,
    training_config,
)

__all__ = [
    "COMMON_OVERRIDES",
    "GIB",
    "PACKAGES",
    "PROMPT",
    "SECTIONS",
    "SPEC_BF16_FLOPS",
    "RandomPriors",
    "Report",
    "Settings",
    "ar_logits_check",
    "build_pipeline",
    "counting_moves",
    "decode_bytes_per_step",
    "dit_update_flops",
    "environment",
    "main",
    "measure_bandwidth",
    "measure_matmul",
    "measured",
    "numel",
    "parse_settings",
    "render_markdown",
    "run_checks",
    "run_decoding",
    "run_text_to_image",
    "spec_peak_flops",
    "synchronize",
    "target_rows",
    "time_decoding",
    "time_text_to_image",
    "train_step",
    "training_config",
]

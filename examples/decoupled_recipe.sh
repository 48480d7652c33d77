#!/usr/bin/env bash
# GLM-Image's decoupled post-training, end to end (docs/decoupled.md):
#
#   1. AR RL (GRPO/DAPO, train_ar.py) with a low-frequency reward;
#   2. prior tokens sampled once from the trained AR model (python -m glm_training.priors);
#   3. DiT RL (Flow-GRPO, train_dit.py) with a high-frequency reward on those priors, the AR model never
#      loaded;
#   4. one exported GlmImagePipeline holding both trained halves (python -m glm_training.export).
#
# The defaults run the tiny offline model on CPU in a few minutes. The JPEG rewards stand in for the real
# ones: compressibility favours smooth, low-detail images (GLM-Image's AR stage used aesthetics and
# alignment), incompressibility favours detail (its DiT stage used text accuracy and detail). On the real
# model, name a recipe for each stage (docs/recipes.md; they hold the real model and its rewards), e.g.
#
#   AR_CONFIG=recipes/dapo_aesthetic_alignment DIT_CONFIG=recipes/flow_grpo_fast_ocr AR_ARGS= DIT_ARGS= \
#     AR_STEPS=300 DIT_STEPS=500 PYTHON="torchrun --nproc_per_node=8" examples/decoupled_recipe.sh
#
# Environment: OUT (output folder), PYTHON (interpreter or launcher), AR_CONFIG / DIT_CONFIG (a config in
# configs/, default the tiny quick-starts), AR_STEPS, DIT_STEPS, NUM_PRIORS, AR_ARGS / DIT_ARGS (extra key=value overrides; DIT_ARGS also go to the priors command, so the cache is made
# at the DiT run's resolution and evaluation settings). A stage whose result exists is skipped, so a rerun
# continues where a previous one stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-outputs/decoupled-recipe}
PYTHON=${PYTHON:-python}
AR_STEPS=${AR_STEPS:-30}
DIT_STEPS=${DIT_STEPS:-40}
NUM_PRIORS=${NUM_PRIORS:-4}
AR_CONFIG=${AR_CONFIG:-ar_training}
DIT_CONFIG=${DIT_CONFIG:-t2i_training}
AR_ARGS=${AR_ARGS:-"reward.names=[jpeg_compressibility]"}
DIT_ARGS=${DIT_ARGS:-"reward.names=[jpeg_incompressibility]"}

final_checkpoint() { printf '%s/checkpoints/step-%06d/trainer_state.json' "$1" "$2"; }

echo "== 1/4 AR RL (low-frequency reward) -> $OUT/ar"
if [[ ! -f $(final_checkpoint "$OUT/ar" "$AR_STEPS") ]]; then
    # shellcheck disable=SC2086
    $PYTHON train_ar.py --config "$AR_CONFIG" trainer.num_steps="$AR_STEPS" \
        eval.every_n_steps="$AR_STEPS" trainer.output_dir="$OUT/ar" trainer.progress_bar=false $AR_ARGS
fi

echo "== 2/4 prior tokens from the trained AR model -> $OUT/priors"
if [[ ! -f $OUT/priors/manifest.json ]]; then
    # shellcheck disable=SC2086
    $PYTHON -m glm_training.priors --config "$DIT_CONFIG" --output "$OUT/priors" \
        --num-priors-per-prompt "$NUM_PRIORS" model.ar_weights="$OUT/ar" eval.every_n_steps="$DIT_STEPS" \
        $DIT_ARGS
fi

echo "== 3/4 DiT RL (high-frequency reward) on the cached priors -> $OUT/dit"
if [[ ! -f $(final_checkpoint "$OUT/dit" "$DIT_STEPS") ]]; then
    # shellcheck disable=SC2086
    $PYTHON train_dit.py --config "$DIT_CONFIG" data.prior_cache="$OUT/priors" \
        model.ar_weights="$OUT/ar" trainer.num_steps="$DIT_STEPS" eval.every_n_steps="$DIT_STEPS" \
        trainer.output_dir="$OUT/dit" trainer.progress_bar=false $DIT_ARGS
fi

echo "== 4/4 combined export -> $OUT/export"
if [[ ! -f $OUT/export/model_index.json ]]; then
    python -m glm_training.export --checkpoint "$OUT/dit" --checkpoint "$OUT/ar" --output "$OUT/export"
fi

echo "held-out evaluation (reward_mean), start -> end:"
for stage in ar dit; do
    first=$(ls "$OUT/$stage/eval/"*.json | head -1)
    last=$(ls "$OUT/$stage/eval/"*.json | tail -1)
    python -c 'import json, sys; a, b = (json.load(open(p))["reward_mean"] for p in sys.argv[2:]); print(f"  {sys.argv[1]}: {a:.4f} -> {b:.4f} ({b - a:+.4f})")' \
        "$stage" "$first" "$last"
done
echo "done: GlmImagePipeline.from_pretrained(\"$OUT/export\")"

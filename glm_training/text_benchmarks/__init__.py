"""The text-rendering benchmarks GLM-Image's model card reports, as their official scripts score them:
CVTG-2K (TextCrafter: word accuracy, NED, CLIPScore) and LongText-Bench (X-Omni: text accuracy, EN and ZH).

`data.py` reads their released files, `metrics.py` holds their metrics as pure functions, `run.py` generates
(or reads) the images, reads their text and writes `benchmark.json`:

    python -m glm_training.evaluate --benchmark cvtg2k --data CVTG-2K --checkpoint outputs/run --output out
"""

"""The text-rendering benchmarks GLM-Image's model card reports, scored with their official scripts' metrics:
CVTG-2K (TextCrafter: word accuracy, NED, CLIPScore) and LongText-Bench (X-Omni: text accuracy, EN and ZH).
The reader is not the official one (RapidOCR, not PaddleOCR or Qwen2.5-VL): every result carries the reader's
own ceiling on the same prompts.

`data.py` reads their released files, `metrics.py` holds their metrics as pure functions, `layout.py` says
where each prompt's images are, `ceiling.py` renders the ground truth for the reader's ceiling, `table.py`
lays the numbers out as the model card does, and `run.py` generates (or reads) the images, reads their text
and writes `benchmark.json`:

    python -m glm_training.evaluate --benchmark cvtg2k --data CVTG-2K --checkpoint outputs/run --output out
"""

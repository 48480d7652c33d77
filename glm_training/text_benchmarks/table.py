"""The table people publish, in the layout of GLM-Image's model card and TextCrafter's paper.

- CVTG-2K: word accuracy at 2, 3, 4 and 5 regions (each pooled over CVTG and CVTG-Style), their average (the
  word accuracy pooled over every word, as the official script reports it: the published averages are not
  the mean of the four columns), NED and CLIPScore;
- LongText-Bench: text accuracy on EN and on ZH and their mean.

Each cell is read from `metrics.summarise`'s numbers (no metric is computed here) and carries its counts:
a word-accuracy cell its correct and total words, a LongText cell its matched and total words (EN) or
characters (ZH), NED its number of words, CLIPScore its number of images.
"""

from __future__ import annotations

from glm_training.text_benchmarks.data import CVTG_REGIONS

CVTG_COLUMNS = (*(f"{n} regions" for n in CVTG_REGIONS), "average", "NED", "CLIPScore")
LONGTEXT_COLUMNS = ("EN", "ZH", "mean")


def _word_cell(summary: dict) -> dict:
    return {
        "value": summary.get("word_accuracy"),
        "num_correct": summary.get("num_correct", 0),
        "num_words": summary.get("num_words", 0),
    }


def _text_cell(summary: dict) -> dict:
    return {
        "value": summary.get("text_accuracy"),
        "num_matched": summary.get("num_matched", 0),
        "num_units": summary.get("num_units", 0),
    }


def published_row(benchmark: str, summary: dict) -> dict[str, dict]:
    """Column name -> {"value", its counts} of one row (the model's scores, or the reader's ceiling); a
    column with no images (e.g. under `--limit`) has the value None and zero counts."""
    cells = summary["per_subset"]
    if benchmark == "cvtg2k":
        row = {f"{n} regions": _word_cell(cells.get(f"regions={n}", {})) for n in CVTG_REGIONS}
        row["average"] = _word_cell(summary)
        row["NED"] = {"value": summary["ned"], "num_words": summary["num_words"]}
        row["CLIPScore"] = {"value": summary["clip_score"], "num_images": summary["num_images"]}
        return row
    return {
        "EN": _text_cell(cells.get("language=en", {})),
        "ZH": _text_cell(cells.get("language=zh", {})),
        "mean": {"value": summary["text_accuracy"]},
    }


def format_table(benchmark: str, rows: dict[str, dict[str, dict]]) -> str:
    """The rows as a fixed-width text table, values to 4 decimals ("-" for none), a header of the columns."""
    columns = CVTG_COLUMNS if benchmark == "cvtg2k" else LONGTEXT_COLUMNS
    first = max(len(name) for name in rows)
    widths = [max(len(column), 6) for column in columns]
    lines = ["  ".join([" " * first, *(c.rjust(w) for c, w in zip(columns, widths))])]
    for name, row in rows.items():
        values = [row[c]["value"] for c in columns]
        shown = ["-" if v is None else f"{v:.4f}" for v in values]
        lines.append("  ".join([name.ljust(first), *(s.rjust(w) for s, w in zip(shown, widths))]))
    return "\n".join(lines)

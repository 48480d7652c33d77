"""The benchmarks' metrics as their official scripts compute them, as pure functions.

What is official here is the arithmetic: the ground truth, the normalisation, the matching and the pooling
below follow TextCrafter's `unified_metrics_eval.py` and X-Omni's `textbench/` line by line. What is not is
the reader whose text they score (`run.py`): RapidOCR instead of CVTG-2K's PaddleOCR 2.10 English models and
instead of LongText-Bench's Qwen2.5-VL-7B-Instruct; `benchmark.json`'s `reader_ceiling` measures what that
costs on cleanly rendered ground truth (`ceiling.py`).

CVTG-2K (`TextCrafter_Eval/unified_metrics_eval.py`):
- the ground truth is every single-quoted span of the prompt, lowercased and split on whitespace,
  punctuation kept (`cvtg_words`);
- the prediction is the recognised text lowercased and split on whitespace (`[""]` when empty); not in the
  official script: it is NFKC-folded first (`rewards.ocr.normalize_text`), since RapidOCR's Chinese-English
  recogniser emits full-width forms (`ＯＰＥＮ`, `５０％`) that PaddleOCR's English model does not;
- word accuracy: a ground-truth word counts when it is among the predicted words (membership, recall only);
- NED: per ground-truth word, `1 - Lev(gt, best) / (max(|gt|, |best|) + 1e-5)` with `best` the predicted word
  `difflib.get_close_matches` ranks first (a similarity: higher is better);
- pooled over every ground-truth word of a subset or of the whole benchmark (the published "average" column
  is this pooled accuracy, not the mean of the four region columns); CLIPScore `2.5 max(cos, 0)` of the
  image and "A photo depicts " + prompt, averaged over images.

LongText-Bench (X-Omni `textbench/summary_scores.py`):
- text and recognised text keep CJK, ASCII letters and digits, whitespace and French accented letters only
  (the rest deleted); EN collapses whitespace and lowercases, ZH drops all whitespace, case kept;
- matched = the multiset intersection of the ground truth's words (EN) or characters (ZH) with the
  recognised ones; the score is sum(matched) / sum(ground truth) over all images of a language, and the
  reported average is the mean of EN and ZH.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Iterable

from glm_training.rewards.ocr import levenshtein, normalize_text
from glm_training.text_benchmarks.data import BenchmarkPrompt

NED_EPS = 1e-5
CLIP_PREFIX = "A photo depicts "
_LONGTEXT_DROP = re.compile(r"[^\u4e00-\u9fa5a-zA-Z0-9\sàâäéèêëîïôöùûüçÀÂÄÉÈÊËÎÏÔÖÙÛÜÇ]")
_LONGTEXT_KEEP_ZH = re.compile(r"[\u4e00-\u9fa5a-zA-Z0-9àâäéèêëîïôöùûüçÀÂÄÉÈÊËÎÏÔÖÙÛÜÇ]")


def cvtg_spans(prompt: str) -> list[str]:
    """The text regions of a CVTG-2K prompt: its single-quoted spans, as written."""
    return re.findall(r"'(.*?)'", prompt)


def cvtg_words(prompt: str) -> list[str]:
    """The words a CVTG-2K prompt asks for: its single-quoted spans, lowercased, split on whitespace."""
    return [word for span in cvtg_spans(prompt) for word in span.lower().split()]


def cvtg_scores(words: list[str], recognised: str) -> tuple[int, int, list[float]]:
    """(ground-truth words, correct words, each word's NED similarity) of one image."""
    predicted = normalize_text(recognised).split() or [""]
    correct = sum(1 for word in words if word in predicted)
    neds = []
    for word in words:
        best = difflib.get_close_matches(word, predicted, n=1, cutoff=0)
        neds.append(
            1 - levenshtein(word, best[0]) / (max(len(word), len(best[0])) + NED_EPS) if best else 0.0
        )
    return len(words), correct, neds


def longtext_normalise(text: str, language: str) -> str:
    if language == "en":
        return re.sub(r"\s+", " ", _LONGTEXT_DROP.sub("", text)).strip().lower()
    return "".join(_LONGTEXT_KEEP_ZH.findall(text)).strip()


def longtext_counts(text: Iterable[str], recognised: str, language: str) -> tuple[int, int]:
    """(matched, ground-truth) words (EN) or characters (ZH) of one image."""
    truth = longtext_normalise(" ".join(text), language)
    read = longtext_normalise(recognised, language)
    truth_units, read_units = (Counter(s.split()) if language == "en" else Counter(s) for s in (truth, read))
    return sum((truth_units & read_units).values()), sum(truth_units.values())


def score_text(benchmark: str, prompt: BenchmarkPrompt, recognised: str) -> dict:
    """The metric fields of one image's record from the text read in it: CVTG-2K's `total`, `correct` and
    `neds`, LongText-Bench's `matched` and `total`."""
    if benchmark == "cvtg2k":
        total, correct, neds = cvtg_scores(cvtg_words(prompt.prompt), recognised)
        return {"total": total, "correct": correct, "neds": neds}
    matched, total = longtext_counts(prompt.text, recognised, prompt.language)
    return {"matched": matched, "total": total}


def cvtg_summary(records: list[dict]) -> dict:
    """Pooled word accuracy (and its counts) and NED, mean CLIPScore (None when any image has none)."""
    total = sum(r["total"] for r in records)
    correct = sum(r["correct"] for r in records)
    neds = [n for r in records for n in r["neds"]]
    clips = [r["clip_score"] for r in records]
    return {
        "num_images": len(records),
        "num_words": total,
        "num_correct": correct,
        "word_accuracy": correct / total if total else None,
        "ned": sum(neds) / len(neds) if neds else None,
        "clip_score": sum(clips) / len(clips) if clips and None not in clips else None,
    }


def longtext_summary(records: list[dict]) -> dict:
    """Pooled text accuracy and its counts: matched and ground-truth words (EN) or characters (ZH)."""
    total = sum(r["total"] for r in records)
    matched = sum(r["matched"] for r in records)
    return {
        "num_images": len(records),
        "num_units": total,
        "num_matched": matched,
        "text_accuracy": matched / total if total else None,
    }


def by_subset(records: list[dict], keys: list[tuple[str, ...]], summary) -> dict[str, dict]:
    """`summary` of the records of each value of each tuple of subset keys, e.g. ("subset", "regions")."""
    table: dict[str, dict] = {}
    for key in keys:
        values = sorted({tuple(r["subset"][k] for k in key) for r in records})
        for value in values:
            name = "/".join(f"{k}={v}" for k, v in zip(key, value))
            table[name] = summary([r for r in records if tuple(r["subset"][k] for k in key) == value])
    return table


def summarise(benchmark: str, records: list[dict]) -> dict:
    """`benchmark.json`'s numbers: overall, and `per_subset`."""
    if benchmark == "cvtg2k":
        keys = [("subset",), ("regions",), ("subset", "regions")]
        return {**cvtg_summary(records), "per_subset": by_subset(records, keys, cvtg_summary)}
    keys = [("language",), ("language", "category"), ("language", "length")]
    per_subset = by_subset(records, keys, longtext_summary)
    languages = [per_subset.get(f"language={lang}", {}).get("text_accuracy") for lang in ("en", "zh")]
    present = [x for x in languages if x is not None]
    return {
        "text_accuracy": sum(present) / len(present) if present else None,
        "text_accuracy_en": languages[0],
        "text_accuracy_zh": languages[1],
        "per_subset": per_subset,
    }

"""OCR reward (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470, section on visual text rendering).

reward = 1 - min(1, levenshtein(recognised, target) / len(target)), in [0, 1], both strings
normalised first (see `normalize_text`).

- target: `metadata["text"]` when present, else the text quoted in the prompt. Quotes are found with
  the four patterns diffusers' `GlmImagePipeline.get_glyph_texts` uses ('...', "...", “...”, 「...」),
  so the reward targets the text the pipeline feeds its glyph encoder; spans are joined with one
  space in the order they appear in the prompt. Like diffusers, two apostrophes ("the cat's ... dog's")
  form a spurious single-quoted span: prefer double quotes, or a `text` field in the prompt file.
- recogniser: RapidOCR (PP-OCRv4 detection + recognition as ONNX models inside the
  `rapidocr-onnxruntime` wheel, so it runs offline on CPU). Recognised fragments are joined with one
  space in RapidOCR's reading order (top to bottom, left to right).

Differences from Flow-GRPO's PaddleOCR scorer: spaces are collapsed rather than deleted, and a
target that is a substring of the recognised text is not given full credit (extra text costs
insertions). Speed: images are upscaled to `min_side` pixels on their short side (tiny models
produce 32x32 images, too small for the detector) and the detector caps the long side at `max_side`
(PaddleOCR's default 960; RapidOCR's own default instead upscales every image to a 736-pixel short
side, ~10x slower on a 512x128 banner). Measured on 2 shared CPU cores with detection: ~0.1 s per
64x64 image, ~0.2 s per 512x128, 0.3-0.6 s per 1024x1024; without detection ~0.05 s.

The held-out evaluation's text metrics (`eval.text_metrics`, GLM-Image's word accuracy and normalised edit
distance) are `word_accuracy` and `normalized_edit_distance` below, read with the same recogniser.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

import numpy as np
import torch
from PIL import Image

from glm_training.rewards.registry import Reward, register_reward

# The patterns of diffusers' GlmImagePipeline.get_glyph_texts (checked against diffusers 0.42.1).
_QUOTE_PATTERNS = (
    re.compile(r"'([^']*)'"),
    re.compile(r"\u201c([^\u201c\u201d]*)\u201d"),
    re.compile(r'"([^"]*)"'),
    re.compile(r"「([^「」]*)」"),
)

MISSING_TEXT_FIX = "add quotes around the text to render, or a `text` field in the JSONL prompt file"


def levenshtein(a: str, b: str) -> int:
    """Edit distance (unit-cost insertions, deletions, substitutions) between `a` and `b`."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Canonical form compared by the OCR reward.

    NFKC folds the full-width letters and punctuation the (Chinese-trained) recogniser may emit into
    their ASCII forms; lowercasing ignores case, which OCR often gets wrong on stylised text; runs of
    whitespace become one space and the ends are stripped, so the split of the text into detected
    boxes (joined with spaces) does not matter beyond one space per split.
    """
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def quoted_text(prompt: str) -> str:
    """The quoted spans of `prompt` joined with one space in prompt order ("" when none)."""
    spans = [(m.start(), m.group(1)) for pattern in _QUOTE_PATTERNS for m in pattern.finditer(prompt)]
    return " ".join(text for _, text in sorted(spans) if text.strip())


def target_text(prompt: str, metadata: dict) -> str:
    """The normalised text the image should show: `metadata["text"]`, else the prompt's quotes."""
    text = metadata.get("text")
    if text is None:
        text = quoted_text(prompt)
    elif not isinstance(text, str):
        raise ValueError(f"metadata `text` must be a string, got {type(text).__name__} for prompt {prompt!r}")
    return normalize_text(text)


def ocr_score(recognised: str, target: str) -> float:
    """1 - min(1, levenshtein / len(target)) on normalised strings; `target` must be non-empty."""
    recognised, target = normalize_text(recognised), normalize_text(target)
    assert target, "empty OCR target; check_prompts should have rejected it"
    return 1.0 - min(1.0, levenshtein(recognised, target) / len(target))


def normalized_edit_distance(recognised: str, target: str) -> float:
    """NED = levenshtein(r, t) / max(len(r), len(t)) on normalised strings, in [0, 1]; 0 when both are empty.

    The text-rendering metric GLM-Image reports (lower is better); unlike `ocr_score` it is not clipped and
    divides by the longer string, so extra recognised text counts as much as missing text.
    """
    recognised, target = normalize_text(recognised), normalize_text(target)
    longer = max(len(recognised), len(target))
    return levenshtein(recognised, target) / longer if longer else 0.0


def word_accuracy(recognised: str, target: str) -> float:
    """Fraction of the target's words found among the recognised words, in [0, 1] (higher is better).

    Both strings are normalised and split on whitespace; words are matched as multisets, so each recognised
    word matches at most one target word ("la la" read as "la" scores 1/2). `target` must hold a word.
    """
    target_words = normalize_text(target).split()
    if not target_words:
        raise ValueError("word_accuracy needs a target with at least one word, got an empty target")
    matched = Counter(target_words) & Counter(normalize_text(recognised).split())
    return sum(matched.values()) / len(target_words)


@register_reward("ocr")
class OcrReward(Reward):
    """Flow-GRPO's OCR reward with RapidOCR.

    Args:
        use_det: run text detection and recognise each detected box. False recognises the whole
            image as one text line: about 10x faster, only right for images that are one line of text.
        min_confidence: recognised fragments below this recogniser confidence are dropped. Flow-GRPO
            keeps every fragment (0.0), so partial legibility still earns partial reward.
        min_side: images whose short side is smaller are upscaled (bicubic) towards it before OCR,
            without taking the long side past `max_side`.
        max_side: the detector downscales images whose long side is larger to this (PaddleOCR's
            default 960); lower is faster, at the cost of small text.
        num_threads: onnxruntime intra-op threads per model; None uses all cores. Set it when
            several ranks share one machine's CPUs.
    """

    approx_params = 250_000_000  # TrOCR-base-sized recogniser (approximate): the memory plan's figure

    def __init__(
        self,
        use_det: bool = True,
        min_confidence: float = 0.0,
        min_side: int = 256,
        max_side: int = 960,
        num_threads: int | None = None,
    ) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"ocr min_confidence must be in [0, 1], got {min_confidence}")
        if not 32 <= min_side <= max_side:
            raise ValueError(
                f"ocr needs 32 <= min_side <= max_side, got min_side={min_side}, max_side={max_side}"
            )
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"ocr num_threads must be >= 1 or None (all cores), got {num_threads}")
        # Imported here: onnxruntime + opencv + model loading take ~0.4 s, paid only if `ocr` is used.
        from rapidocr_onnxruntime import RapidOCR

        engine_options = {} if num_threads is None else {"intra_op_num_threads": num_threads}
        self.engine = RapidOCR(
            use_cls=False,  # text is rendered upright; Flow-GRPO also runs PaddleOCR with cls=False
            text_score=min_confidence,
            det_limit_type="max",
            det_limit_side_len=max_side,
            **engine_options,
        )
        self.use_det = use_det
        self.min_confidence = min_confidence
        self.min_side = min_side
        self.max_side = max_side

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        if len(metadata) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(metadata)} metadata entries")
        for index, (prompt, meta) in enumerate(zip(prompts, metadata)):
            if not target_text(prompt, meta):
                raise ValueError(
                    f"the ocr reward needs text to render, but prompt {index} ({prompt!r}) has no "
                    f"quoted text and no `text` metadata: {MISSING_TEXT_FIX}"
                )

    def recognise(self, image: Image.Image) -> str:
        """The text RapidOCR reads in `image`, fragments joined with spaces ("" when none)."""
        image = image.convert("RGB")
        # Upscaling past the detector's long-side cap would only be undone by its own resize.
        scale = min(self.min_side / min(image.size), self.max_side / max(image.size))
        if scale > 1.0:
            image = image.resize(
                (round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC
            )
        bgr_hwc = np.ascontiguousarray(np.asarray(image)[:, :, ::-1])
        result, _ = self.engine(bgr_hwc, use_det=self.use_det, use_cls=False)
        if not result:
            return ""
        # With detection each entry is [box, text, confidence]; without, [text, confidence].
        fragments = [entry[-2] for entry in result if float(entry[-1]) >= self.min_confidence]
        return " ".join(fragments)

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(
                f"ocr reward got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
            )
        scores = []
        for image, prompt, meta in zip(images, prompts, metadata):
            target = target_text(prompt, meta)
            if not target:
                raise ValueError(f"prompt {prompt!r} has no text for the ocr reward: {MISSING_TEXT_FIX}")
            scores.append(ocr_score(self.recognise(image), target))
        return torch.tensor(scores, dtype=torch.float32)

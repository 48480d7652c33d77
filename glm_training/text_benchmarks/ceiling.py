"""The reader's own ceiling: what the benchmark's score would be for perfect images.

Each prompt's ground truth is rendered cleanly, black on white in one font, and read by the reader that reads
the model's images, then scored by the same metric code (`metrics.score_text`). The benchmark's reader is
not the official one (`metrics.py`), so this is the part of a score lost to the reader alone; a model's score
is read against it, not against 1.

- ground truth: CVTG-2K's quoted spans (the official script's ground truth), one region per line, as written
  in the prompt; LongText-Bench's `text`, one entry per line;
- rendering: `CEILING_FONT_SIZE`-pixel text on a `CEILING_SIDE`-pixel square (the size of the published
  images, so the reader scales it as it scales theirs), lines wrapped at the words (inside a word for
  scripts without spaces), the font shrunk until a long text fits; one image per prompt (LongText-Bench's
  four images of a prompt would be identical). The layout is a choice the figure depends on by up to about
  3 points (font sizes 32-64 px gave word accuracies 0.962-0.994 on 157 words): this reader sometimes drops
  a space ("GOOD MORNING" read "GOODMORNING") at one size and not at another;
- font: Pillow's built-in one (Aileron Regular, the same on every machine; what the tests render with), or
  `--ceiling-font PATH`. Aileron has ASCII only: a prompt with a character the font has no glyph for (accented
  letters, CJK) is skipped and counted, never drawn as boxes; give a font that has them (e.g. Noto Sans CJK
  for LongText-Bench's ZH half) to measure those.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from glm_training.errors import UserError
from glm_training.image_grid import wrap_text
from glm_training.text_benchmarks.data import BenchmarkPrompt
from glm_training.text_benchmarks.metrics import cvtg_spans, score_text

CEILING_SIDE = 1024  # the published images' size: the reader resizes the canvas as it resizes theirs
CEILING_FONT_SIZE = 48
MIN_FONT_SIZE = 16
MARGIN = 32
LINE_HEIGHT = 1.6  # in font sizes: lines the detector keeps apart
_NO_GLYPH = "\U0010fffd"  # a private-use code point fonts leave unmapped: drawn as the "missing glyph" box


class CeilingFontError(UserError):
    """`--ceiling-font` cannot be loaded, or Pillow has no FreeType for its built-in font."""


def load_font(path: str | None, size: int = CEILING_FONT_SIZE) -> ImageFont.FreeTypeFont:
    """The font at `path` (TrueType / OpenType / collection), or Pillow's built-in Aileron when None."""
    if path is None:
        font = ImageFont.load_default(size=size)
        if not isinstance(font, ImageFont.FreeTypeFont):
            raise CeilingFontError(
                "Pillow was built without FreeType, so its built-in font has one small size: give "
                "--ceiling-font PATH (a .ttf / .otf) for the reader ceiling."
            )
        return font
    try:
        return ImageFont.truetype(str(Path(path).expanduser()), size)
    except OSError as err:
        raise CeilingFontError(
            f"--ceiling-font {path}: cannot load it as a font ({err}); give a .ttf, .otf or .ttc file."
        ) from err


def font_name(font: ImageFont.FreeTypeFont) -> str:
    return " ".join(part for part in font.getname() if part)


def missing_glyphs(font: ImageFont.FreeTypeFont, text: str) -> set[str]:
    """The characters of `text` the font has no glyph for: those drawn as the font's missing-glyph box."""
    box = font.getmask(_NO_GLYPH)
    box_key = (box.size, bytes(box))

    def drawn_as_box(char: str) -> bool:
        mask = font.getmask(char)
        return (mask.size, bytes(mask)) == box_key

    return {char for char in set(text) if not char.isspace() and drawn_as_box(char)}


def ground_truth_lines(benchmark: str, prompt: BenchmarkPrompt) -> list[str]:
    """What a perfect image of `prompt` shows: CVTG-2K's quoted spans, LongText-Bench's `text` entries."""
    lines = cvtg_spans(prompt.prompt) if benchmark == "cvtg2k" else list(prompt.text)
    return [line for line in lines if line.strip()]


def wrap(lines: list[str], font: ImageFont.FreeTypeFont, width: int) -> list[str]:
    """`lines` broken to fit `width` pixels (`image_grid.wrap_text`: at spaces, and inside a word only when it
    alone is too wide), none cut short: a line of n characters wraps to at most n."""
    return [part for line in lines for part in wrap_text(line, font, width, max_lines=len(line) + 1)]


def render_lines(lines: list[str], font: ImageFont.FreeTypeFont, side: int = CEILING_SIDE) -> Image.Image:
    """Black text on a white `side` x `side` canvas, one wrapped line under the other from the top left; the
    font shrinks (by tenths, to `MIN_FONT_SIZE` at least) until every line fits."""
    room = side - 2 * MARGIN
    while True:
        wrapped = wrap(lines, font, room)
        step = round(font.size * LINE_HEIGHT)
        if step * len(wrapped) <= room or font.size <= MIN_FONT_SIZE:
            break
        font = font.font_variant(size=max(MIN_FONT_SIZE, int(font.size * 0.9)))
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    for row, line in enumerate(wrapped):
        draw.text((MARGIN, MARGIN + row * step), line, fill="black", font=font)
    return image


def ceiling_records(
    benchmark: str,
    prompts: list[BenchmarkPrompt],
    read: Callable[[Image.Image], str],
    font: ImageFont.FreeTypeFont,
) -> tuple[list[dict], list[str]]:
    """(one record per prompt its ground truth rendered and read, as `run.py` records a model's image; the
    image names of the prompts skipped for characters the font cannot draw)."""
    texts = {prompt.image_name: ground_truth_lines(benchmark, prompt) for prompt in prompts}
    missing = missing_glyphs(font, "".join("".join(lines) for lines in texts.values()))
    records, skipped = [], []
    for prompt in prompts:
        lines = texts[prompt.image_name]
        if missing & set("".join(lines)):
            skipped.append(prompt.image_name)
            continue
        recognised = read(render_lines(lines, font))
        record = {"image": prompt.image_name, "subset": prompt.subset, "recognised": recognised}
        record.update(score_text(benchmark, prompt, recognised))
        if benchmark == "cvtg2k":
            record["clip_score"] = None  # text on white says nothing about the prompt's scene
        records.append(record)
    return records, skipped

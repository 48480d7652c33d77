"""Captioned image grids for experiment trackers: sampled images side by side with their prompts and rewards.

Layout (all in pixels): every image is fitted, aspect ratio kept, into a `cell_w x cell_h` cell and centred on
white; under each cell a white band of `caption_band_height(cell_w)` pixels holds its caption, word-wrapped to
the cell width in PIL's default font and cut to `max_caption_lines` lines with "..." (cutting the prompt of a
`caption`, never its reward). Cells sit in
`num_columns` columns, row-major, `GRID_GAP` white pixels apart, so a grid of `n` images is

    width  = num_columns * cell_w + (num_columns - 1) * GRID_GAP
    height = num_rows * (cell_h + band_h) + (num_rows - 1) * GRID_GAP,   num_rows = ceil(n / num_columns)

and the image of index `i` has its cell's top-left corner at
`((i % num_columns) * (cell_w + GRID_GAP), (i // num_columns) * (cell_h + band_h + GRID_GAP))`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from PIL import Image, ImageDraw, ImageFont

GRID_GAP = 4
"""White pixels between neighbouring cells, horizontally and vertically."""

DEFAULT_MAX_CELL_SIDE = 512
"""Without `cell_size`, cells are scaled down to at most this longer side so logged grids stay small."""

_CAPTION_PAD = 2
_WHITE = (255, 255, 255)
_TEXT_COLOR = (0, 0, 0)
_CAPTION_SEPARATOR = " | "
_ELLIPSIS = "..."  # ASCII: PIL's bitmap fallback font has no U+2026 glyph

Font = ImageFont.ImageFont | ImageFont.FreeTypeFont


def caption(prompt: str, reward: float | None, extras: Mapping[str, float] | None = None) -> str:
    """The caption of one sample: `"<prompt> | reward 0.731"`, or the prompt alone when `reward` is None.

    `extras` (label -> score, e.g. the evaluation's watched rewards) follow the reward in the same tail,
    `"<prompt> | reward 0.731; jpeg_incompressibility 3.860"`, so a cut caption keeps them with it.
    """
    scores = [] if reward is None else [f"reward {float(reward):.3f}"]
    scores += [f"{label} {float(value):.3f}" for label, value in (extras or {}).items()]
    if not scores:
        return prompt
    return f"{prompt}{_CAPTION_SEPARATOR}{'; '.join(scores)}"


def _font_size(cell_width: int) -> int:
    # 10 px text stays legible on 64 px cells; larger cells get proportionally larger text.
    return max(10, cell_width // 24)


def _default_font(size: int) -> Font:
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow without FreeType: the fixed-size bitmap font
        return ImageFont.load_default()


def _line_height(font: Font) -> int:
    if isinstance(font, ImageFont.FreeTypeFont):
        ascent, descent = font.getmetrics()
        return ascent + descent
    return font.getbbox("Ag")[3]


def caption_band_height(cell_width: int, max_caption_lines: int = 3) -> int:
    """Height in pixels of the white caption band under a cell `cell_width` pixels wide."""
    line_height = _line_height(_default_font(_font_size(cell_width)))
    return max_caption_lines * line_height + 2 * _CAPTION_PAD


def _drawable(text: str, font: Font) -> str:
    # The bitmap fallback font encodes text as Latin-1 and raises on anything else (e.g. Chinese prompts);
    # FreeType fonts draw a placeholder box for missing glyphs by themselves.
    if isinstance(font, ImageFont.FreeTypeFont):
        return text
    return text.encode("latin-1", errors="replace").decode("latin-1")


def _longest_fitting_prefix(text: str, font: Font, width: int) -> int:
    """How many leading characters of `text` fit in `width` pixels (at least 1, so wrapping advances)."""
    for end in range(len(text), 0, -1):
        if font.getlength(text[:end]) <= width:
            return end
    return 1


def wrap_text(text: str, font: Font, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap to `width` pixels; overlong words are split; past `max_lines` lines -> '...'."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while font.getlength(word) > width:
            cut = _longest_fitting_prefix(word, font, width)
            lines.append(word[:cut])
            word = word[cut:]
        current = word
        if len(lines) > max_lines:
            break  # long prompts: the rest would be cut anyway
    if current:
        lines.append(current)
    if len(lines) <= max_lines:
        return lines
    last = lines[max_lines - 1]
    while last and font.getlength(last + _ELLIPSIS) > width:
        last = last[:-1]
    return [*lines[: max_lines - 1], last.rstrip() + _ELLIPSIS]


def _wrap_caption(text: str, font: Font, width: int, max_lines: int) -> list[str]:
    """`wrap_text`, except that a caption too long for the band loses the end of its prompt, not its reward.

    The part after the last " | " (e.g. "reward 0.731", see `caption`) is kept whole when it fits in fewer
    than `max_lines` lines; the prompt before it is cut with "..." to the lines left.
    """
    lines = wrap_text(text, font, width, max_lines)
    if not lines or not lines[-1].endswith(_ELLIPSIS) or _CAPTION_SEPARATOR not in text:
        return lines
    prompt, tail = text.rsplit(_CAPTION_SEPARATOR, 1)
    tail_lines = wrap_text("| " + tail, font, width, max_lines)
    if len(tail_lines) >= max_lines:
        return lines
    return [*wrap_text(prompt, font, width, max_lines - len(tail_lines)), *tail_lines]


def _cell_shape(reference: Image.Image, cell_size: int | None) -> tuple[int, int]:
    """(cell_w, cell_h): `reference`'s aspect ratio, its longer side `cell_size` (or the capped default)."""
    width, height = reference.size
    longer = max(width, height)
    target = min(longer, DEFAULT_MAX_CELL_SIDE) if cell_size is None else cell_size
    if target == longer:
        return width, height
    scale = target / longer
    return max(1, round(width * scale)), max(1, round(height * scale))


def _fit(image: Image.Image, cell_w: int, cell_h: int) -> Image.Image:
    scale = min(cell_w / image.width, cell_h / image.height)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    image = image.convert("RGB")
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.LANCZOS)


def make_image_grid(
    images: list[Image.Image],
    captions: list[str],
    *,
    num_columns: int | None = None,
    cell_size: int | None = None,
    max_caption_lines: int = 3,
) -> Image.Image:
    """Paste `images` into an RGB grid, `captions[i]` written under `images[i]` (layout: module docstring).

    Args:
        images: PIL images of any sizes and modes; each is fitted into the cell, aspect ratio kept.
        captions: one string per image (see `caption`).
        num_columns: columns of the grid; default `ceil(sqrt(len(images)))`, at most `len(images)`.
        cell_size: the cell's longer side in pixels; the cell takes the aspect ratio of `images[0]`.
            Default: the size of `images[0]`, scaled down to a longer side of at most 512.
        max_caption_lines: caption lines kept under each image; longer captions end with "...".
    """
    if not images:
        raise ValueError("make_image_grid needs at least one image, got an empty list")
    if len(captions) != len(images):
        raise ValueError(
            f"make_image_grid needs one caption per image, got {len(images)} images and {len(captions)} "
            "captions; pass a caption list of the same length (use '' for no caption)"
        )
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(
                f"make_image_grid expects PIL images, images[{index}] is a {type(image).__name__}; "
                "convert tensors or arrays with PIL.Image.fromarray first"
            )
    if num_columns is not None and num_columns < 1:
        raise ValueError(f"num_columns must be >= 1, got {num_columns}")
    if cell_size is not None and cell_size < 1:
        raise ValueError(f"cell_size must be >= 1 pixel, got {cell_size}")
    if max_caption_lines < 1:
        raise ValueError(f"max_caption_lines must be >= 1, got {max_caption_lines}")

    num_images = len(images)
    num_columns = min(num_columns or math.ceil(math.sqrt(num_images)), num_images)
    num_rows = math.ceil(num_images / num_columns)
    cell_w, cell_h = _cell_shape(images[0], cell_size)
    font = _default_font(_font_size(cell_w))
    line_height = _line_height(font)
    band_h = caption_band_height(cell_w, max_caption_lines)

    grid = Image.new(
        "RGB",
        (
            num_columns * cell_w + (num_columns - 1) * GRID_GAP,
            num_rows * (cell_h + band_h) + (num_rows - 1) * GRID_GAP,
        ),
        _WHITE,
    )
    draw = ImageDraw.Draw(grid)
    text_width = max(1, cell_w - 2 * _CAPTION_PAD)
    for index, (image, text) in enumerate(zip(images, captions, strict=True)):
        left = (index % num_columns) * (cell_w + GRID_GAP)
        top = (index // num_columns) * (cell_h + band_h + GRID_GAP)
        fitted = _fit(image, cell_w, cell_h)
        grid.paste(fitted, (left + (cell_w - fitted.width) // 2, top + (cell_h - fitted.height) // 2))
        lines = _wrap_caption(_drawable(text, font), font, text_width, max_caption_lines)
        for line_index, line in enumerate(lines):
            position = (left + _CAPTION_PAD, top + cell_h + _CAPTION_PAD + line_index * line_height)
            draw.text(position, line, fill=_TEXT_COLOR, font=font)
    return grid

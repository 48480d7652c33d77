"""Where each benchmark prompt's images are: the layout generation writes, and the layouts `--images` reads.

- CVTG-2K: one image per prompt, `<subset>/<regions>/<index>.png` (`CVTG-Style/3/12.png`).
- LongText-Bench: four images per prompt in one folder per language. Generation writes
  `<language>/<prompt_id>_<k>.png` with k = 0..3; `--images` also reads X-Omni's own layout, where each
  language's `--sample_dir` is one folder of `<prompt_id>_<k>.png` (`0000_1.png` ... `0000_4.png`): a
  file belongs to the prompt whose id its name starts with (up to the first `_`, zero-padding ignored), as
  X-Omni's `textbench` script assigns them, and a prompt's images are taken in the order of their `k`.
"""

from __future__ import annotations

from pathlib import Path

from glm_training.text_benchmarks.data import BenchmarkDataError, BenchmarkPrompt

REPEATS = {"cvtg2k": 1, "longtext": 4}  # images per prompt, as the official scripts expect


def image_paths(prompts: list[BenchmarkPrompt], benchmark: str, folder: Path) -> list[tuple[int, int, Path]]:
    """(prompt index, repeat, path) of every image the benchmark scores, where generation writes it."""
    repeats = REPEATS[benchmark]
    suffix = (lambda k: "") if repeats == 1 else (lambda k: f"_{k}")
    return [
        (i, k, folder / f"{p.image_name}{suffix(k)}.png")
        for i, p in enumerate(prompts)
        for k in range(repeats)
    ]


def _id_key(text: str) -> int | str:
    """An image name's prompt id as X-Omni reads it (`int("0003")` == 3); non-numeric ids as written."""
    return int(text) if text.isdigit() else text


def _repeat_key(path: Path) -> tuple[int, int | str]:
    tail = path.stem.partition("_")[2]
    return (0, int(tail)) if tail.isdigit() else (1, tail)


def existing_images(
    prompts: list[BenchmarkPrompt], benchmark: str, folder: Path
) -> list[tuple[int, int, Path]]:
    """(prompt index, repeat, path) of the images already in `folder`, in either layout above; an error
    names what is missing or ambiguous."""
    expected = (
        f"expected the {benchmark} layout (python -m glm_training.evaluate --benchmark {benchmark} "
        "--checkpoint RUN writes it under OUTPUT/images)"
    )
    if benchmark == "cvtg2k":
        items = image_paths(prompts, benchmark, folder)
        missing = [str(path) for _, _, path in items if not path.is_file()]
        if missing:
            raise BenchmarkDataError(
                f"--images {folder}: {len(missing)} of {len(items)} images missing, e.g. {missing[0]}; "
                f"{expected}."
            )
        return items
    expected += "; or X-Omni's, its EN and ZH sample_dir as en/ and zh/, e.g. en/0000_1.png ... en/0000_4.png"
    repeats = REPEATS[benchmark]
    found: dict[tuple[str, int | str], list[Path]] = {}
    for language in sorted({Path(p.image_name).parent.as_posix() for p in prompts}):
        for path in sorted((folder / language).glob("*.png")):
            found.setdefault((language, _id_key(path.stem.partition("_")[0])), []).append(path)
    items = []
    for i, prompt in enumerate(prompts):
        name = Path(prompt.image_name)
        paths = sorted(found.get((name.parent.as_posix(), _id_key(name.name)), []), key=_repeat_key)
        if len(paths) != repeats:
            shown = ", ".join(p.name for p in paths) or "none"
            raise BenchmarkDataError(
                f"--images {folder}: prompt {prompt.image_name} has {len(paths)} images ({shown}), "
                f"expected {repeats}; {expected}."
            )
        items += [(i, k, path) for k, path in enumerate(paths)]
    return items

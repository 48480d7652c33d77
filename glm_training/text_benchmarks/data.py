"""The benchmarks' released files, read and checked before any model loads.

- CVTG-2K (TextCrafter, HF `dnkdnk/CVTG-2K`): `CVTG/{2,3,4,5}.json` and `CVTG-Style/{2,3,4,5}.json`, each
  `{"data_list": [{"index", "prompt", "carrier_list", "sentence_list"}, ...]}`; the file's number is the
  number of text regions. The style folder is spelled `CVTG-Style`, `CVTG_Style` or (TextCrafter's README)
  `CVTG-style` by different copies: any case, with `-` or `_`, is accepted; results and images always name
  it `CVTG-Style`. The text to render is every single-quoted span of the prompt (the official
  script's ground truth; `sentence_list` is not read). One image per prompt, `<subset>/<N>/<index>.png`.
- LongText-Bench (X-Omni, HF `X-Omni/LongText-Bench`): `text_prompts.jsonl` (EN) and `text_prompts_zh.jsonl`
  (ZH), a line `{"prompt_id", "prompt", "text": [...], "category", "length", "text_length"}` each; `text` is
  what must be rendered. Four images per prompt, `<language>/<prompt_id>_<k>.png`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glm_training.errors import UserError

CVTG_SUBSETS = ("CVTG", "CVTG-Style")
CVTG_REGIONS = (2, 3, 4, 5)
LONGTEXT_FILES = {"en": "text_prompts.jsonl", "zh": "text_prompts_zh.jsonl"}
LONGTEXT_KEYS = ("prompt_id", "prompt", "text", "category", "length")
BENCHMARKS = ("cvtg2k", "longtext")


class BenchmarkDataError(UserError):
    """A benchmark's data folder is missing, incomplete or not in its released format."""


@dataclass(frozen=True)
class BenchmarkPrompt:
    prompt: str
    image_name: str  # where its image goes, relative to the images folder (without the repeat suffix)
    subset: dict[str, str]  # the subsets it belongs to, e.g. {"subset": "CVTG-Style", "regions": "3"}
    text: tuple[str, ...] = ()  # LongText-Bench: the text to render (CVTG-2K reads it from the prompt)
    language: str = "en"


def _read_json(path: Path, expected: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BenchmarkDataError(f"{path}: cannot read it as JSON ({err}); expected {expected}.") from err


def _subset_folder(folder: Path, subset: str) -> Path:
    """`folder`'s sub-folder for `subset`, in any case and with `-` or `_` (`CVTG_Style` for `CVTG-Style`)."""
    spelled = subset.lower().replace("_", "-")
    found = sorted(p for p in folder.iterdir() if p.is_dir() and p.name.lower().replace("_", "-") == spelled)
    if len(found) > 1:
        raise BenchmarkDataError(
            f"{folder} holds {' and '.join(p.name for p in found)}: two spellings of the {subset} subset; "
            "keep one."
        )
    return found[0] if found else folder / subset


def load_cvtg2k(folder: Path) -> list[BenchmarkPrompt]:
    """Every prompt of CVTG-2K's released layout (both subsets, 2-5 regions); errors name the path."""
    expected = 'CVTG-2K\'s {"data_list": [{"index", "prompt", ...}, ...]}'
    subsets = {s: _subset_folder(folder, s) for s in CVTG_SUBSETS}
    missing = [
        f"{s}/{n}.json"
        for s in CVTG_SUBSETS
        for n in CVTG_REGIONS
        if not (subsets[s] / f"{n}.json").is_file()
    ]
    if missing:
        raise BenchmarkDataError(
            f"{folder} is not a CVTG-2K folder: {', '.join(missing)} missing; expected CVTG/2.json ... "
            "CVTG/5.json and CVTG-Style/2.json ... 5.json (also spelled CVTG_Style; the unzipped CVTG-2K.zip "
            "of HF dnkdnk/CVTG-2K)."
        )
    prompts = []
    for subset in CVTG_SUBSETS:
        for regions in CVTG_REGIONS:
            path = subsets[subset] / f"{regions}.json"
            data = _read_json(path, expected)
            entries = data.get("data_list") if isinstance(data, dict) else None
            if not isinstance(entries, list) or not entries:
                raise BenchmarkDataError(f"{path}: no non-empty data_list; expected {expected}.")
            for i, entry in enumerate(entries):
                if not (
                    isinstance(entry, dict) and isinstance(entry.get("prompt"), str) and "index" in entry
                ):
                    raise BenchmarkDataError(
                        f"{path}: data_list[{i}] has no index and prompt; expected {expected}."
                    )
                prompts.append(
                    BenchmarkPrompt(
                        prompt=entry["prompt"],
                        image_name=f"{subset}/{regions}/{entry['index']}",
                        subset={"subset": subset, "regions": str(regions)},
                    )
                )
    return prompts


def load_longtext(folder: Path) -> list[BenchmarkPrompt]:
    """Every prompt of LongText-Bench's two files (EN, ZH); errors name the path and the line."""
    missing = [name for name in LONGTEXT_FILES.values() if not (folder / name).is_file()]
    if missing:
        raise BenchmarkDataError(
            f"{folder} is not a LongText-Bench folder: {', '.join(missing)} missing; expected "
            "text_prompts.jsonl (EN) and text_prompts_zh.jsonl (ZH) of HF X-Omni/LongText-Bench."
        )
    prompts = []
    for language, name in LONGTEXT_FILES.items():
        path = folder / name
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError as err:
                raise BenchmarkDataError(f"{path}:{number}: not JSON ({err}).") from err
            absent = (
                [k for k in LONGTEXT_KEYS if k not in entry]
                if isinstance(entry, dict)
                else list(LONGTEXT_KEYS)
            )
            if absent or not isinstance(entry["text"], list):
                raise BenchmarkDataError(
                    f"{path}:{number}: expected the keys {list(LONGTEXT_KEYS)} with `text` a list of "
                    f"strings; missing {absent or ['a list in text']}."
                )
            prompts.append(
                BenchmarkPrompt(
                    prompt=entry["prompt"],
                    image_name=f"{language}/{entry['prompt_id']}",
                    subset={
                        "language": language,
                        "category": str(entry["category"]),
                        "length": str(entry["length"]),
                    },
                    text=tuple(str(t) for t in entry["text"]),
                    language=language,
                )
            )
    return prompts


def load_benchmark(name: str, folder: str | Path) -> list[BenchmarkPrompt]:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise BenchmarkDataError(
            f"--data {folder} is not a folder; give the benchmark's unzipped data folder."
        )
    return load_cvtg2k(folder) if name == "cvtg2k" else load_longtext(folder)

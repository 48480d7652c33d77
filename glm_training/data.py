"""Prompt files and the prompts each step trains on.

A prompt file is plain text (one prompt per line; blank lines and lines starting with `#` are skipped) or
JSONL (one object per line with a `"prompt"` key; every other key travels with the prompt as metadata, e.g.
`"text"`, the string the OCR reward expects to see rendered).

The prompts of step `s` are a pure function of `(seed, s)`, identical on every rank, so a resumed run
samples exactly what the uninterrupted run would have, with no data-loader state to checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from glm_training.errors import UserError


class PromptFileError(UserError, ValueError):
    """The prompt file is missing, empty or malformed; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(
            f"prompt file '{path}' does not exist; set data.prompt_file to a .txt (one prompt per line) or "
            '.jsonl file (one {"prompt": ...} object per line), or leave it empty for the bundled prompts.'
        )
    prompts: list[Prompt] = []
    is_jsonl = path.suffix == ".jsonl"
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is not part of the first prompt
    except UnicodeDecodeError as err:
        number = data[: err.start].count(b"\n") + 1
        raise PromptFileError(
            f"{path}:{number}: not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); save "
            "the prompt file as UTF-8."
        ) from None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or (not is_jsonl and line.startswith("#")):
            continue
        if not is_jsonl:
            prompts.append(Prompt(line))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}:{number}: not valid JSON ({err.msg}).") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise PromptFileError(f'{path}:{number}: each JSONL line needs a non-empty "prompt" string.')
        text = record.pop("prompt")
        prompts.append(Prompt(text, record))
    if not prompts:
        raise PromptFileError(f"prompt file '{path}' holds no prompts; add at least one prompt line.")
    return prompts


def prompts_for_step(prompts: list[Prompt], num_groups: int, seed: int, step: int) -> list[Prompt]:
    """The `num_groups` prompts of one step (same on every rank): without repeats when there are enough."""
    rng = np.random.default_rng([seed, step])
    replace = num_groups > len(prompts)
    picks = rng.choice(len(prompts), size=num_groups, replace=replace)
    return [prompts[i] for i in picks]

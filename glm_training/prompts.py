"""Prompt sets for text rendering, the task of GLM-Image's decoder RL (and of Flow-GRPO's OCR reward).

    python -m glm_training.prompts ocr --num 2000 --seed 0 --output prompts/ocr_train.jsonl \
        --held-out prompts/ocr_held_out.jsonl --held-out-fraction 0.1
    python -m glm_training.prompts ocr-eval --output glm_training/data/ocr_eval.jsonl   # the bundled file

Each line is `{"prompt": ..., "text": ...}`: a scene, a surface and a style around the words to render, which
appear in the prompt in double quotes (what GLM-Image's pipeline feeds its glyph encoder) and again under
`"text"` (what the OCR reward compares the recognised text with). The vocabulary is the project's own,
`data/ocr_vocabulary.json`: several hundred texts, scenes, surfaces, styles and sentence templates, with no
apostrophes (the pipeline would read the text between two of them as glyph text).

Guarantees (tested): the same arguments give the same file; exactly `--num` prompts, no two equal; the texts
are used evenly (each text once before any twice); the held-out file's texts come from a share of the
vocabulary (`--held-out-fraction`, split by the seed) that the training file never uses, so a held-out score
measures rendering of unseen words. That split is made whether or not `--held-out` is written, so the training
file of a seed does not depend on it. The bundled evaluation set (`glm_training/data/ocr_eval.jsonl`, one
prompt for each of the 64 `eval_texts`) uses texts that no generated training file holds, whatever the seed.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path
from typing import Any

from glm_training.errors import UserError

DATA_DIR = Path(__file__).resolve().parent / "data"
VOCABULARY_FILE = DATA_DIR / "ocr_vocabulary.json"
BUNDLED_OCR_EVAL = DATA_DIR / "ocr_eval.jsonl"


class PromptSetError(UserError, ValueError):
    """Arguments that cannot give the requested prompt set; the message says which and what would."""


@functools.cache
def ocr_vocabulary() -> dict[str, Any]:
    """The vocabulary: texts, eval_texts, scenes, surfaces, styles and templates (lists of strings)."""
    return json.loads(VOCABULARY_FILE.read_text(encoding="utf-8"))


def _rng(seed: int, purpose: str) -> random.Random:
    # One independent stream per purpose, so e.g. the held-out size never changes the training prompts.
    # String seeds are hashed with SHA-512 by `random`, stable across Python versions.
    return random.Random(f"glm-training/{purpose}/{seed}")


def split_texts(seed: int, held_out_fraction: float) -> tuple[list[str], list[str]]:
    """The vocabulary's texts as (training texts, held-out texts): a seeded shuffle, the fraction held out."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise PromptSetError(f"--held-out-fraction must be in [0, 1), got {held_out_fraction}.")
    texts = list(ocr_vocabulary()["texts"])
    _rng(seed, "split").shuffle(texts)
    num_held_out = round(len(texts) * held_out_fraction)
    if held_out_fraction > 0 and num_held_out == 0:
        num_held_out = 1
    return texts[num_held_out:], texts[:num_held_out]


def compose_prompts(texts: list[str], num: int, rng: random.Random) -> list[dict[str, str]]:
    """`num` distinct prompts, the texts used in rounds (a shuffled pass over all of them, then another)."""
    vocab = ocr_vocabulary()
    parts = [vocab[key] for key in ("templates", "styles", "surfaces", "scenes")]
    capacity = len(texts)
    for options in parts:
        capacity *= len(options)
    if num > capacity // 2:  # random draws would mostly collide long before the last combination
        raise PromptSetError(
            f"{num} prompts from {len(texts)} texts is more than this vocabulary makes without repeats "
            f"(~{capacity // 2}); ask for fewer, or a smaller --held-out-fraction."
        )
    prompts: list[dict[str, str]] = []
    seen: set[str] = set()
    queue: list[str] = []
    while len(prompts) < num:
        if not queue:
            queue = list(texts)
            rng.shuffle(queue)
        text = queue.pop()
        for _ in range(1000):
            template, style, surface, scene = (rng.choice(options) for options in parts)
            prompt = template.format(style=style, surface=surface, scene=scene, text=text)
            if prompt not in seen:
                break
        else:  # pragma: no cover - needs a vocabulary of a handful of words
            raise PromptSetError(f"could not find a new prompt for {text!r}; ask for fewer prompts.")
        seen.add(prompt)
        prompts.append({"prompt": prompt, "text": text})
    return prompts


def ocr_prompt_sets(
    num: int, seed: int = 0, num_held_out: int = 0, held_out_fraction: float = 0.1
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(training prompts, held-out prompts) as `{"prompt", "text"}` dicts; see the module docstring."""
    if num < 1:
        raise PromptSetError(f"--num must be >= 1, got {num}.")
    if num_held_out < 0:
        raise PromptSetError(f"--num-held-out must be >= 0, got {num_held_out}.")
    train_texts, held_out_texts = split_texts(seed, held_out_fraction)
    if num_held_out and not held_out_texts:
        raise PromptSetError("a held-out set needs --held-out-fraction > 0 (e.g. 0.1).")
    train = compose_prompts(train_texts, num, _rng(seed, "train"))
    held_out = compose_prompts(held_out_texts, num_held_out, _rng(seed, "held-out")) if num_held_out else []
    return train, held_out


def bundled_eval_prompts() -> list[dict[str, str]]:
    """The bundled held-out OCR evaluation set: one prompt for each reserved `eval_texts` entry."""
    texts = ocr_vocabulary()["eval_texts"]
    return compose_prompts(texts, len(texts), _rng(0, "bundled-eval"))


def write_jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text(lines, encoding="utf-8")
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.prompts",
        description="Write text-rendering prompt sets ({'prompt', 'text'} JSONL) for the ocr reward.",
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    ocr = sub.add_parser("ocr", help="a training set (and optionally a held-out set with unseen texts)")
    ocr.add_argument("--num", type=int, required=True, help="number of training prompts")
    ocr.add_argument("--seed", type=int, default=0, help="the same seed gives the same files")
    ocr.add_argument("--output", type=Path, required=True, help="the training .jsonl file")
    ocr.add_argument("--held-out", type=Path, help="also write a held-out .jsonl file")
    ocr.add_argument(
        "--held-out-fraction",
        type=float,
        default=0.1,
        help="share of the vocabulary's texts kept for the held-out set only (default 0.1)",
    )
    ocr.add_argument(
        "--num-held-out", type=int, help="held-out prompts (default: --num x --held-out-fraction, at least 1)"
    )
    bundled = sub.add_parser(
        "ocr-eval", help="the bundled evaluation set (reserved texts, never in training)"
    )
    bundled.add_argument("--output", type=Path, default=BUNDLED_OCR_EVAL)
    return parser


def main(argv: list[str] | None = None) -> int:
    from glm_training.errors import report_user_errors

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)

    def body() -> str:
        if args.kind == "ocr-eval":
            records = bundled_eval_prompts()
            return f"wrote {len(records)} prompts to {write_jsonl(args.output, records)}"
        num_held_out = 0
        if args.held_out is not None:
            num_held_out = args.num_held_out
            if num_held_out is None:
                num_held_out = max(1, round(args.num * args.held_out_fraction))
        elif args.num_held_out:
            raise PromptSetError("--num-held-out needs --held-out FILE to write them to.")
        train, held_out = ocr_prompt_sets(args.num, args.seed, num_held_out, args.held_out_fraction)
        message = f"wrote {len(train)} prompts to {write_jsonl(args.output, train)}"
        if args.held_out is not None:
            message += f" and {len(held_out)} held-out prompts to {write_jsonl(args.held_out, held_out)}"
        return message

    return report_user_errors(body)


if __name__ == "__main__":
    raise SystemExit(main())

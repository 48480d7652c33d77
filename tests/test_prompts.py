"""Text-rendering prompt sets: deterministic, exact count, no duplicates, held-out texts unseen, OCR-ready."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import PYTHON, run_cli

from glm_training.data import load_prompts
from glm_training.prompts import (
    BUNDLED_OCR_EVAL,
    PromptSetError,
    bundled_eval_prompts,
    ocr_prompt_sets,
    ocr_vocabulary,
)
from glm_training.rewards import build_reward
from glm_training.rewards.ocr import normalize_text, quoted_text


def rendered(records) -> set[str]:
    return {normalize_text(r["text"]) for r in records}


def test_the_vocabulary_is_large_and_safe_for_the_glyph_encoder():
    vocab = ocr_vocabulary()
    sizes = {key: len(vocab[key]) for key in ("texts", "eval_texts", "scenes", "surfaces", "styles")}
    assert sizes["texts"] >= 400 and min(sizes.values()) >= 30, sizes
    for key in ("texts", "eval_texts", "scenes", "surfaces", "styles"):
        normalised = [normalize_text(x) for x in vocab[key]]
        assert len(set(normalised)) == len(normalised), f"duplicates in {key}"
        # An apostrophe pair would be read as quoted glyph text by GlmImagePipeline.get_glyph_texts.
        assert not any(c in x for x in vocab[key] for c in "'\"“”「」"), key
    assert not set(map(normalize_text, vocab["texts"])) & set(map(normalize_text, vocab["eval_texts"]))


def test_sets_are_deterministic_distinct_and_held_out_texts_are_unseen():
    train, held_out = ocr_prompt_sets(600, seed=3, num_held_out=50, held_out_fraction=0.2)
    again_train, again_held_out = ocr_prompt_sets(600, seed=3, num_held_out=50, held_out_fraction=0.2)
    assert (train, held_out) == (again_train, again_held_out)
    assert len(train) == 600 and len(held_out) == 50
    assert len({r["prompt"] for r in train + held_out}) == 650  # no duplicate anywhere
    assert not rendered(train) & rendered(held_out)
    assert not rendered(train) & rendered(bundled_eval_prompts())
    # Texts are used in rounds: with 373 training texts, 600 prompts use each once or twice.
    counts = Counter(r["text"] for r in train)
    assert set(counts.values()) == {1, 2} and len(counts) == len(ocr_vocabulary()["texts"]) - 93
    # Another seed gives other prompts; the training file does not depend on the held-out size.
    assert ocr_prompt_sets(600, seed=4, held_out_fraction=0.2)[0] != train
    assert ocr_prompt_sets(600, seed=3, held_out_fraction=0.2)[0] == train


def test_every_prompt_quotes_exactly_its_text_and_the_ocr_check_accepts_them():
    train, held_out = ocr_prompt_sets(200, seed=0, num_held_out=20)
    records = train + held_out + bundled_eval_prompts()
    for r in records:
        # The pipeline's glyph text (what the prompt quotes) is the OCR target.
        assert quoted_text(r["prompt"]) == r["text"], r
    ocr = build_reward("ocr", use_det=False)
    ocr.check_prompts([r["prompt"] for r in records], [{"text": r["text"]} for r in records])
    # Without the text key the quotes alone carry the target.
    ocr.check_prompts([r["prompt"] for r in records], [{} for _ in records])


def test_bad_requests_are_user_errors():
    with pytest.raises(PromptSetError, match="--num"):
        ocr_prompt_sets(0)
    with pytest.raises(PromptSetError, match="held-out-fraction"):
        ocr_prompt_sets(10, held_out_fraction=1.0)
    with pytest.raises(PromptSetError, match="--held-out-fraction > 0"):
        ocr_prompt_sets(10, num_held_out=5, held_out_fraction=0.0)
    with pytest.raises(PromptSetError, match="ask for fewer"):
        ocr_prompt_sets(10**10)


def test_command_line_writes_files_the_trainers_load(tmp_path):
    train, held = tmp_path / "ocr.jsonl", tmp_path / "held.jsonl"
    args = ["--num", "120", "--seed", "7", "--output", str(train), "--held-out", str(held)]
    result = run_cli([PYTHON, "-m", "glm_training.prompts", "ocr", *args], timeout=60)
    assert result.returncode == 0, result.stderr
    prompts = load_prompts(train)
    assert len(prompts) == 120 and len(load_prompts(held)) == 12  # 10% by default
    expected, _ = ocr_prompt_sets(120, seed=7, num_held_out=12)
    assert [{"prompt": p.text, **p.metadata} for p in prompts] == expected

    bad = run_cli([PYTHON, "-m", "glm_training.prompts", "ocr", "--num", "5", "--output", str(train),
                   "--num-held-out", "3"], timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--held-out FILE" in bad.stderr and "Traceback" not in bad.stderr


def test_the_bundled_eval_file_is_what_the_generator_writes():
    lines = BUNDLED_OCR_EVAL.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == bundled_eval_prompts()
    assert len(lines) == len(ocr_vocabulary()["eval_texts"]) == 64

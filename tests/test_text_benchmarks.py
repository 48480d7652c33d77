"""The text-rendering benchmarks (`glm_training/text_benchmarks/`): their metrics against the official
scripts' formulas on known strings, the scores of images with known text rendered into them against numbers
worked out by hand here, the data checks before any model loads, generation with the tiny model, and 2 ranks
under torchrun giving the 1-rank result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, torchrun
from PIL import Image
from test_rewards import render_text

from glm_training.evaluate import main as evaluate_main
from glm_training.text_benchmarks.metrics import (
    NED_EPS,
    cvtg_scores,
    cvtg_words,
    longtext_counts,
    summarise,
)


def test_the_metrics_follow_the_official_formulas_on_known_strings():
    # CVTG-2K: the quoted spans, lowercased, punctuation kept; membership; NED against difflib's best match.
    prompt = "A sign that says 'Open 24/7' and a cup with the word 'SALE!'."
    assert cvtg_words(prompt) == ["open", "24/7", "sale!"]
    assert cvtg_scores(["read", "morning"], "Read MORNlNG coffee") == (2, 1, [1.0, pytest.approx(1 - 1 / 7)])
    # Punctuation matters: "sale!" is not read as "sale" (one deletion of 5 characters: 0.8).
    assert cvtg_scores(["sale!"], "SALE") == (1, 0, [pytest.approx(1 - 1 / (5 + NED_EPS))])
    assert cvtg_scores(["a"], "") == (1, 0, [pytest.approx(1 - 1 / (1 + NED_EPS))])  # nothing read: [""]
    # LongText-Bench: punctuation deleted (not replaced), EN words lowercased, ZH characters case-sensitive.
    text = ["CENTRAL PARK - 2 BLOCKS", "Visit EVExpo2023.com"]
    assert longtext_counts(text, "Central Park – 2 blocks\nVisit EVExpo2023.com", "en") == (6, 6)
    assert longtext_counts(["Visit EVExpo"], "visit evexpo", "zh") == (7, 11)
    assert longtext_counts(["a a b"], "a b b", "en") == (2, 3)  # multiset intersection


def _cell(folder: Path, subset: str, regions: int, prompt: str) -> None:
    (folder / subset).mkdir(parents=True, exist_ok=True)
    data = {"data_list": [{"index": 0, "prompt": prompt, "carrier_list": [], "sentence_list": []}]}
    (folder / subset / f"{regions}.json").write_text(json.dumps(data), encoding="utf-8")


# (subset, regions) -> (prompt, the text rendered into its image; None = a blank image)
CVTG = {
    ("CVTG", 2): ("A shop sign that says 'SALE TODAY'.", "SALE TODAY"),
    ("CVTG", 3): ("A door that says 'OPEN 24/7' and a mug that says 'READ'.", "OPEN 24/7"),
    ("CVTG", 4): ("A poster with the word 'X'.", None),
    ("CVTG", 5): ("A banner with the word 'X'.", None),
    ("CVTG-Style", 2): ("A neon sign that says 'GOOD MORNING'.", "GOOD MORNING"),
    ("CVTG-Style", 3): ("A board with the word 'X'.", None),
    ("CVTG-Style", 4): ("A card with the word 'X'.", None),
    ("CVTG-Style", 5): ("A flag with the word 'X'.", None),
}


@pytest.fixture(scope="module")
def cvtg(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, images folder) of a small CVTG-2K: one prompt per file, known text in the images."""
    root = tmp_path_factory.mktemp("cvtg")
    data, images = root / "CVTG-2K", root / "images"
    for (subset, regions), (prompt, shown) in CVTG.items():
        _cell(data, subset, regions, prompt)
        path = images / subset / str(regions) / "0.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        (render_text(shown) if shown else Image.new("RGB", (512, 128), "white")).save(path)
    return data, images


def test_cvtg2k_scores_images_with_known_text_as_worked_out_by_hand(cvtg, tmp_path):
    data, images = cvtg
    assert (
        evaluate_main(
            ["--benchmark", "cvtg2k", "--data", str(data), "--images", str(images), "--output", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "benchmark.json").read_text())
    # By hand: SALE TODAY 2 of 2 words read exactly; OPEN 24/7 + READ: 2 of 3, and "read" is nearest to
    # "open" (no letter in place: distance 4); GOOD MORNING 2 of 2; the five blank images read nothing, their
    # one-letter word "x" scores 1 - 1 / (1 + 1e-5) each.
    blank = 1 - 1 / (1 + NED_EPS)
    neds = [1, 1] + [1, 1, 1 - 4 / (4 + NED_EPS)] + [1, 1] + [blank] * 5
    assert result["num_words"] == 12 and result["num_images"] == 8
    assert result["word_accuracy"] == pytest.approx(6 / 12)
    assert result["ned"] == pytest.approx(sum(neds) / len(neds))
    cell = result["per_subset"]["subset=CVTG/regions=3"]
    assert cell["word_accuracy"] == pytest.approx(2 / 3) and cell["num_words"] == 3
    assert result["per_subset"]["subset=CVTG-Style"]["word_accuracy"] == pytest.approx(2 / 5)
    assert result["per_subset"]["regions=2"]["word_accuracy"] == 1.0
    # No CLIP weights offline: the OCR metrics stand, CLIPScore is null.
    assert result["clip_score"] is None
    assert (tmp_path / "benchmark.png").is_file()
    # Two ranks share the images and gather the records: the same result.
    script = str(REPO / "glm_training" / "evaluate.py")
    two = tmp_path / "two_ranks"
    args = ["--benchmark", "cvtg2k", "--data", str(data), "--images", str(images), "--output", str(two)]
    launched = torchrun(script, args, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert json.loads((two / "benchmark.json").read_text()) == result


def test_longtext_scores_each_language_and_their_mean(tmp_path):
    data, images = tmp_path / "LongText", tmp_path / "images"
    data.mkdir()
    entry = {"category": "sign", "length": "short", "text_length": 2}
    en = {**entry, "prompt_id": 3, "prompt": 'A sign that reads "SALE TODAY".', "text": ["SALE TODAY"]}
    zh = {**entry, "prompt_id": 3, "prompt": "一个写着 OPEN 的牌子", "text": ["OPEN"]}
    (data / "text_prompts.jsonl").write_text(json.dumps(en) + "\n", encoding="utf-8")
    (data / "text_prompts_zh.jsonl").write_text(json.dumps(zh, ensure_ascii=False) + "\n", encoding="utf-8")
    for k in range(4):  # EN: two of its four images show the text, two are blank; ZH: all four show it
        for language, shown in (("en", "SALE TODAY" if k < 2 else None), ("zh", "OPEN")):
            path = images / language / f"3_{k}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            (render_text(shown) if shown else Image.new("RGB", (512, 128), "white")).save(path)
    out = tmp_path / "out"
    assert (
        evaluate_main(
            ["--benchmark", "longtext", "--data", str(data), "--images", str(images), "--output", str(out)]
        )
        == 0
    )
    result = json.loads((out / "benchmark.json").read_text())
    # EN: 2 + 2 + 0 + 0 of 4 x 2 words; ZH: 4 characters of 4 in every image; the mean of the two.
    assert result["text_accuracy_en"] == pytest.approx(0.5)
    assert result["text_accuracy_zh"] == pytest.approx(1.0)
    assert result["text_accuracy"] == pytest.approx(0.75)
    assert result["per_subset"]["language=en/category=sign"]["num_units"] == 8


def test_a_missing_or_malformed_data_folder_stops_before_any_model_loads(tmp_path, capsys):
    base = ["--config", "configs/t2i_training.yaml", "--output", str(tmp_path / "out")]
    assert evaluate_main(["--benchmark", "cvtg2k", "--data", str(tmp_path / "nowhere"), *base]) == 2
    assert "is not a folder" in capsys.readouterr().err
    _cell(tmp_path / "c", "CVTG", 2, "A sign that says 'A'.")
    assert evaluate_main(["--benchmark", "cvtg2k", "--data", str(tmp_path / "c"), *base]) == 2
    err = capsys.readouterr().err
    assert "CVTG/3.json" in err and "CVTG-Style/2.json" in err and "expected CVTG/2.json" in err
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "text_prompts.jsonl").write_text('{"prompt_id": 1, "prompt": "x"}\n')
    (tmp_path / "l" / "text_prompts_zh.jsonl").write_text("")
    assert evaluate_main(["--benchmark", "longtext", "--data", str(tmp_path / "l"), *base]) == 2
    assert "text_prompts.jsonl:1: expected the keys" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_tiny_model_generates_the_benchmarks_layout_and_is_scored(cvtg, tmp_path, caplog):
    data, _ = cvtg
    out = tmp_path / "out"
    small = ["sampling.height=32", "sampling.width=32", "sampling.num_steps=2", "eval.batch_size=3"]
    args = ["--benchmark", "cvtg2k", "--data", str(data), "--config", "configs/t2i_training.yaml"]
    assert evaluate_main([*args, "--output", str(out), "--limit", "3", *small]) == 0
    result = json.loads((out / "benchmark.json").read_text())
    assert result["num_images"] == 3 and result["num_words"] == 2 + 3 + 1
    assert sorted(p.relative_to(out / "images").as_posix() for p in (out / "images").rglob("*.png")) == [
        "CVTG/2/0.png",
        "CVTG/3/0.png",
        "CVTG/4/0.png",
    ]
    assert result["clip_score"] is None and "clip_score is null" in caplog.text
    assert summarise("cvtg2k", result["images"])["word_accuracy"] == result["word_accuracy"]
    for what in ("generated", "scored"):  # progress through the images, up to the last
        assert f"[benchmark] {what} 0 of 3 images" in caplog.text
        assert f"[benchmark] {what} 3 of 3 images" in caplog.text


def test_evaluate_help_shows_the_benchmark_mode_and_its_options_are_refused_without_it(capsys):
    with pytest.raises(SystemExit) as shown:
        evaluate_main(["--help"])
    assert shown.value.code == 0
    out = capsys.readouterr().out
    assert "text-rendering benchmarks" in out
    assert all(flag in out for flag in ("--benchmark {cvtg2k,longtext}", "--data", "--images", "--limit"))
    with pytest.raises(SystemExit) as refused:
        evaluate_main(["--config", "configs/t2i_training.yaml", "--data", "CVTG-2K", "--limit", "3"])
    assert refused.value.code == 2
    assert "--data --limit: options of the benchmark mode; add --benchmark {cvtg2k,longtext}" in (
        capsys.readouterr().err
    )

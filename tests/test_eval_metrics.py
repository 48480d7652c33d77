"""The evaluation's guards against reward hacking: text metrics computed by hand, watched rewards and text
metrics in the result, the scalars and the grid captions, and the config checks that run before any model."""

from __future__ import annotations

import random

import pytest
from conftest import DIT_SMALL

from glm_training.cli import run
from glm_training.config import ConfigError, load_config
from glm_training.data import Prompt
from glm_training.engine.trainer import DiTTrainer
from glm_training.evaluation import (
    check_eval_prompts,
    eval_scalars,
    grid_samples,
    summarise_text_metrics,
    watched_reward_set,
)
from glm_training.image_grid import caption
from glm_training.rewards.ocr import levenshtein, normalized_edit_distance, word_accuracy

# --------------------------------------------------------------------------- the metrics, by hand


def test_word_accuracy_and_ned_worked_example():
    # target "hello big world" (15 characters, words hello/big/world), read as "helo world" (10, helo/world):
    # only "world" matches, so word accuracy = 1/3. Edit distance: delete one "l" of "hello" and "big "
    # (4 characters) = 5, and no fewer is possible (the lengths differ by 5): NED = 5 / max(10, 15) = 1/3.
    assert levenshtein("helo world", "hello big world") == 5
    assert word_accuracy("helo world", "hello big world") == pytest.approx(1 / 3, abs=1e-12)
    assert normalized_edit_distance("helo world", "hello big world") == pytest.approx(5 / 15, abs=1e-12)


def test_word_accuracy_matches_words_as_a_multiset():
    # target la, la, land; read la, land, land: one "la" and one "land" match -> 2/3. Edit distance: insert
    # "nd" after the second "la" of "la la land" -> "la land land": 2 (= the length difference), NED 2/12.
    assert word_accuracy("la land land", "la la land") == pytest.approx(2 / 3, abs=1e-12)
    assert normalized_edit_distance("la land land", "la la land") == pytest.approx(2 / 12, abs=1e-12)
    # Extra recognised words cost word accuracy nothing, but NED counts them: 6 insertions / 11.
    assert word_accuracy("hello world", "world") == 1.0
    assert normalized_edit_distance("hello world", "world") == pytest.approx(6 / 11, abs=1e-12)


def test_metrics_compare_normalised_text_and_handle_empty_strings():
    # Case, full-width letters and runs of spaces are normalised away (`normalize_text`).
    assert word_accuracy("ＨＥＬＬＯ   World", "hello world") == 1.0
    assert normalized_edit_distance("ＨＥＬＬＯ   World", "hello world") == 0.0
    assert normalized_edit_distance("", "") == 0.0  # both empty: nothing to edit
    assert normalized_edit_distance("", "ok") == 1.0  # 2 insertions / 2
    assert word_accuracy("", "ok") == 0.0
    with pytest.raises(ValueError, match="at least one word"):
        word_accuracy("ok", "   ")


def test_word_accuracy_equals_greedy_matching():
    # An independent formulation: strike each target word from a list of the recognised words.
    def greedy(recognised: str, target: str) -> float:
        left, hits = recognised.split(), 0
        for word in target.split():
            if word in left:
                left.remove(word)
                hits += 1
        return hits / len(target.split())

    rng = random.Random(0)
    for _ in range(200):
        # Short words over a two-letter alphabet, so words repeat and partly match.
        recognised = "".join(rng.choices("ab  ", k=rng.randint(0, 12)))
        target = "".join(rng.choices("ab  ", k=rng.randint(0, 12))) + " a"
        assert word_accuracy(recognised, target) == pytest.approx(greedy(recognised, target), abs=1e-12)
        r, t = " ".join(recognised.split()), " ".join(target.split())
        assert 0.0 <= normalized_edit_distance(recognised, target) <= 1.0
        assert normalized_edit_distance(recognised, target) * max(len(r), len(t)) == pytest.approx(
            levenshtein(r, t)
        )


# --------------------------------------------------------------------------- the result, scalars, captions


def _result() -> dict:
    rows = [
        {"target": "open", "recognised": "OPEN", "word_accuracy": 1.0, "normalized_edit_distance": 0.0},
        None,  # a prompt without text
        {"target": "a b", "recognised": "a", "word_accuracy": 0.5, "normalized_edit_distance": 2 / 3},
    ]
    return {
        "reward_mean": -2.0,
        "rewards": {"jpeg_compressibility": {"weight": 1.0, "mean": -2.0, "per_prompt": [-1.0, -2.0, -3.0]}},
        "total_per_prompt": [-1.0, -2.0, -3.0],
        "prompts": ['a sign "OPEN"', "a cat", 'a sign "a b"'],
        "watched": {"jpeg_incompressibility": {"mean": 2.0, "per_prompt": [1.0, 2.0, 3.0]}},
        "text_metrics": summarise_text_metrics(rows),
    }


def test_text_metrics_average_over_the_prompts_with_text():
    text = _result()["text_metrics"]
    assert (text["num_with_text"], text["num_without_text"]) == (2, 1)
    assert text["word_accuracy"] == pytest.approx((1.0 + 0.5) / 2)
    assert text["normalized_edit_distance"] == pytest.approx((0.0 + 2 / 3) / 2)
    none = summarise_text_metrics([None])
    assert none["word_accuracy"] is None and none["normalized_edit_distance"] is None


def test_scalars_and_captions_carry_watched_rewards_and_text_metrics():
    result = _result()
    assert eval_scalars(result) == {
        "eval/reward_mean": -2.0,
        "eval/reward/jpeg_compressibility": -2.0,
        "eval/watched/jpeg_incompressibility": 2.0,
        "eval/text/word_accuracy": pytest.approx(0.75),
        "eval/text/ned": pytest.approx(1 / 3),
    }
    images, captions = grid_samples(result, ["img0", "img1", "img2"], 2)
    assert images == ["img0", "img1"]
    assert captions == [
        'a sign "OPEN" | reward -1.000; jpeg_incompressibility 1.000; word acc 1.000; NED 0.000',
        "a cat | reward -2.000; jpeg_incompressibility 2.000",
    ]
    # Without the guards, the scalars and captions are what they always were.
    plain = {k: v for k, v in result.items() if k not in ("watched", "text_metrics")}
    assert set(eval_scalars(plain)) == {"eval/reward_mean", "eval/reward/jpeg_compressibility"}
    assert grid_samples(plain, ["img0"], 1)[1] == [caption('a sign "OPEN"', -1.0)]
    assert caption("a cat", None, {"ocr": 0.5}) == "a cat | ocr 0.500"


# --------------------------------------------------------------------------- config checks


@pytest.mark.parametrize(
    ("override", "key", "needle"),
    [
        ("eval.watch_rewards=[ocr,ocr]", "eval.watch_rewards", "more than once"),
        ("+eval.watch_reward_options.ocr.use_det=false", "eval.watch_reward_options", "not in eval.watch"),
    ],
)
def test_eval_config_rejects_bad_watch_keys(override, key, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        load_config([override])
    assert err.value.key == key


def test_watched_reward_that_also_trains_fails_before_any_model(capsys, tmp_path):
    cfg = load_config(["eval.watch_rewards=[jpeg_compressibility]"])
    with pytest.raises(ConfigError, match="also in reward.names") as err:
        watched_reward_set(cfg)
    assert err.value.key == "eval.watch_rewards"
    small = [a for a in DIT_SMALL if not a.startswith("eval.every_n_steps")]
    args = [*small, "eval.every_n_steps=1", "eval.watch_rewards=[jpeg_compressibility]"]
    assert run(DiTTrainer, "t2i_training", [*args, f"trainer.output_dir={tmp_path}"]) == 2
    assert "config key 'eval.watch_rewards'" in capsys.readouterr().err
    assert not (tmp_path / "config.yaml").exists()  # stopped before the run started


def test_watched_rewards_get_their_own_options_and_prompt_checks():
    cfg = load_config(
        ["eval.watch_rewards=[jpeg_incompressibility,ocr]", "+eval.watch_reward_options.ocr.use_det=false"]
    )
    watched = watched_reward_set(cfg)
    assert watched.names == ["jpeg_incompressibility", "ocr"] and not watched.rewards["ocr"].use_det
    with pytest.raises(ValueError, match="the ocr reward needs text"):
        check_eval_prompts([Prompt('a sign "OPEN"'), Prompt("a cat")], [None, watched], False)


def test_text_metrics_need_one_prompt_with_text():
    check_eval_prompts([Prompt('a sign "OPEN"'), Prompt("a cat")], [], True)  # one without: left out
    with pytest.raises(ConfigError, match="none of the 2 held-out prompts") as err:
        check_eval_prompts([Prompt("a dog"), Prompt("a cat")], [], True)
    assert err.value.key == "eval.text_metrics"
    check_eval_prompts([Prompt("a dog")], [], False)  # off: nothing to check

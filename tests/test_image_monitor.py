"""The reward-hacking monitors: image statistics on images whose values are known by hand, the alarm's rules,
and a run whose toy reward pays for dark images until the alarm stops it at the step the bound is crossed."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

from glm_training.config import ConfigError, load_config
from glm_training.config.schema import HACKING_BOUNDS
from glm_training.engine.monitor import ImageMonitor, RewardHackingAlarm
from glm_training.engine.reporting import best_and_worst
from glm_training.image_stats import (
    STATISTICS,
    group_runs,
    image_statistics,
    pairwise_distance_sum,
    statistic_sums,
    summarise,
    thumbnail,
)
from glm_training.metrics import read_metrics


def _image(array) -> Image.Image:
    return Image.fromarray(np.asarray(array, dtype=np.uint8))


def test_the_config_bounds_name_exactly_the_statistics():
    assert tuple(HACKING_BOUNDS) == STATISTICS


def test_statistics_of_images_known_by_hand():
    black = image_statistics(_image(np.zeros((8, 8, 3))))
    assert black == {
        "brightness": 0.0,
        "dark_fraction": 1.0,
        "bright_fraction": 0.0,
        "colour_entropy": 0.0,
        "edge_density": 0.0,
        "saturation": 0.0,
    }
    split = np.zeros((8, 8, 3))
    split[:, 4:] = 255  # left half black, right half white
    stats = image_statistics(_image(split))
    assert stats["dark_fraction"] == 0.5 and stats["bright_fraction"] == 0.5
    assert stats["brightness"] == pytest.approx(0.5)
    assert stats["colour_entropy"] == pytest.approx(1.0)  # two colours, equally often: one bit
    # Luma steps are measured on the 7x7 pixels with a right and a lower neighbour: column 3 (7 pixels) has
    # a step of 1 to its right.
    assert stats["edge_density"] == pytest.approx(7 / 49)
    assert stats["saturation"] == 0.0  # grey levels
    red = image_statistics(_image(np.full((4, 4, 3), (200, 0, 0))))
    assert red["saturation"] == 1.0 and red["dark_fraction"] == 0.0  # luma 0.299 * 200 / 255 = 0.23
    # A large image is reduced first: a 512 x 512 split image measures as the 256 x 256 one.
    big = np.zeros((512, 512, 3))
    big[:, 256:] = 255
    assert image_statistics(_image(big))["dark_fraction"] == 0.5


def test_diversity_is_the_mean_thumbnail_distance_over_a_groups_pairs():
    black, white, grey = (_image(np.full((16, 16, 3), v)) for v in (0, 255, 51))
    assert pairwise_distance_sum([thumbnail(black), thumbnail(black)]) == (0.0, 1)
    total, count = pairwise_distance_sum([thumbnail(i) for i in (black, white, grey)])
    assert count == 3 and total == pytest.approx(1.0 + 0.2 + 0.8)
    assert group_runs(["a", "a", "b", "a"]) == [[0, 1], [2], [3]]
    sums = statistic_sums([black, white, grey, grey], [[0, 1], [2, 3]])
    assert sums["diversity"] == (pytest.approx(1.0), 2)  # black-white 1, grey-grey 0
    assert sums["dark_fraction"] == (1.0, 4)  # only the black image is dark (grey: luma 0.2)
    summary = summarise([(image_statistics(i), thumbnail(i)) for i in (black, white)])
    assert summary["diversity"] == pytest.approx(1.0) and summary["dark_fraction"] == 0.5


def test_best_and_worst_shows_each_end_once():
    assert best_and_worst([0.1, 0.9, 0.5, 0.3], 2) == [1, 0]
    assert best_and_worst([0.1, 0.9, 0.5, 0.3], 8) == [1, 2, 3, 0]
    assert best_and_worst([0.4], 4) == [0]


def _monitor(*overrides: str) -> ImageMonitor:
    return ImageMonitor(load_config(list(overrides), "t2i_training"))


def test_the_alarm_acts_only_past_a_bound_while_the_reward_rose(caplog):
    monitor = _monitor("eval.hacking_bounds.dark_fraction=0.2")
    first = monitor.with_changes("train", "image/", {"dark_fraction": 0.45, "saturation": 0.3}, -3.0)
    assert first == {
        "image/dark_fraction": 0.45,
        "image/dark_fraction_change": 0.0,
        "image/saturation": 0.3,
        "image/saturation_change": 0.0,
    }

    def record(step, dark, reward):
        values = monitor.with_changes("train", "image/", {"dark_fraction": dark, "saturation": 0.3}, reward)
        return {"step": step, "reward_mean": reward, **values}

    with caplog.at_level(logging.WARNING, logger="glm_training"):
        monitor.check(record(2, 0.60, -2.0))  # within the bound
        monitor.check(record(3, 0.93, -3.5))  # past it, but the reward fell
        assert not caplog.records
        monitor.check(record(4, 0.93, -2.0))
        monitor.check(record(5, 0.95, -1.9))  # said once per statistic
    (warning,) = caplog.records
    assert "step 4: image/dark_fraction moved +0.48 from step 0 (0.45 -> 0.93)" in warning.message
    assert "eval.hacking_bounds.dark_fraction" in warning.message
    stopping = _monitor("eval.hacking_alarm=error", "eval.hacking_bounds.dark_fraction=0.2")
    stopping.baselines = {k: dict(v) for k, v in monitor.baselines.items()}
    with pytest.raises(RewardHackingAlarm, match=r"step 4: image/dark_fraction .* eval.hacking_alarm=error"):
        stopping.check(record(4, 0.93, -2.0))


def test_bad_alarm_settings_are_named():
    with pytest.raises(ConfigError, match="eval.hacking_alarm"):
        load_config(["eval.hacking_alarm=loud"], "t2i_training")
    with pytest.raises(ConfigError, match=r"eval.hacking_bounds.*'darkness'"):
        load_config(["+eval.hacking_bounds.darkness=0.1"], "t2i_training")
    with pytest.raises(ConfigError, match="eval.hacking_alarm.*eval.image_stats=true"):
        load_config(["eval.image_stats=false", "eval.hacking_alarm=error"], "t2i_training")


def darkness(images, prompts, metadata):
    """A toy reward that pays for dark images: 1 - mean luma."""
    return [1.0 - float(np.asarray(i.convert("L"), dtype=np.float32).mean()) / 255.0 for i in images]


@pytest.mark.slow
def test_a_reward_that_darkens_images_stops_the_run_where_the_bound_is_crossed(tmp_path):
    """AWM's tiny run on `darkness`: the mean luma falls (measured 0.41 -> 0.35 in 20 steps) while the reward
    rises; the alarm stops the run at the first step whose brightness is 0.03 below the first step's. (The
    tiny model's random VAE hardly makes near-black pixels: its dark_fraction stays at 0.01-0.02.)"""
    from glm_training.engine.trainer import DiTTrainer

    bound = 0.03
    others = [f"eval.hacking_bounds.{n}=10" for n in STATISTICS if n != "brightness"]
    cfg = load_config(
        [
            "--config",
            "configs/awm_training.yaml",
            "trainer.progress_bar=false",
            "eval.every_n_steps=0",
            f"trainer.output_dir={tmp_path}",
            "trainer.num_steps=20",
            "eval.hacking_alarm=error",
            f"eval.hacking_bounds.brightness={bound}",
            *others,
        ],
        "t2i_training",
    )
    with pytest.raises(RewardHackingAlarm) as err:
        DiTTrainer(cfg, reward_funcs=[darkness]).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert {f"image/{n}" for n in STATISTICS} | {f"image/{n}_change" for n in STATISTICS} <= set(rows[0])
    base_reward = rows[0]["reward_mean"]
    crossed = [
        r["step"] for r in rows if r["image/brightness_change"] < -bound and r["reward_mean"] > base_reward
    ]
    assert crossed and crossed[0] == rows[-1]["step"] > 1, [
        (r["step"], round(r["image/brightness"], 4), round(r["reward_mean"], 4)) for r in rows
    ]
    assert f"step {crossed[0]}: image/brightness moved -" in str(err.value)

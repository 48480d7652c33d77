"""Experiment tracking and captioned image grids: layout arithmetic, TensorBoard event files read back with
TensorBoard's own reader, W&B offline run folders, and the quiet non-main ranks."""

from __future__ import annotations

import io
import math
import sys

import numpy as np
import pytest
import torch
from PIL import Image, ImageFont

from glm_training.image_grid import (
    GRID_GAP,
    _wrap_caption,
    caption,
    caption_band_height,
    make_image_grid,
    wrap_text,
)
from glm_training.tracking import (
    MultiTracker,
    NullTracker,
    TensorBoardTracker,
    TrackerError,
    WandbTracker,
    build_tracker,
    captions_markdown,
)

WHITE = np.array([255, 255, 255], dtype=np.uint8)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def solid_image(width: int, height: int, color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (width, height), color)


# --- image grid -------------------------------------------------------------------------------------------


def test_caption_text():
    assert caption("a cat on a mat", 0.7314) == "a cat on a mat | reward 0.731"
    assert caption("a cat", -3.95) == "a cat | reward -3.950"
    assert caption("a cat", None) == "a cat"


def test_band_height_is_three_lines_of_the_default_font():
    # 30 px cells use the smallest font, 10 px; a line is ascent + descent, plus 2 px padding above and below.
    ascent, descent = ImageFont.load_default(size=10).getmetrics()
    assert caption_band_height(30) == 3 * (ascent + descent) + 2 * 2
    assert caption_band_height(30, max_caption_lines=1) == (ascent + descent) + 2 * 2


def test_grid_layout_five_images_three_columns():
    images = [noise_image(30, 20, seed) for seed in range(5)]
    grid = make_image_grid(images, [f"image {i}" for i in range(5)], num_columns=3)
    band = caption_band_height(30)
    # 5 images in 3 columns -> ceil(5 / 3) = 2 rows; cells are the images' own 30x20 (no resizing).
    assert grid.size == (3 * 30 + 2 * GRID_GAP, 2 * (20 + band) + 1 * GRID_GAP)
    grid_hwc = np.asarray(grid)
    for index, image in enumerate(images):
        row, column = divmod(index, 3)
        left, top = column * (30 + GRID_GAP), row * (20 + band + GRID_GAP)
        np.testing.assert_array_equal(grid_hwc[top : top + 20, left : left + 30], np.asarray(image))
    # Image 4 sits at row 1, column 1: its cell starts at x = 34, y = 20 + band + 4.
    assert tuple(grid_hwc[20 + band + 4 + 7, 34 + 5]) == images[4].getpixel((5, 7))
    # The sixth cell (row 1, column 2) is empty, and so are the gaps.
    empty = grid_hwc[20 + band + GRID_GAP :, 2 * 34 :]
    assert (empty == WHITE).all()
    assert (grid_hwc[:, 30 : 30 + GRID_GAP] == WHITE).all()


def test_caption_band_has_text_only_under_captioned_images():
    images = [solid_image(40, 40, (200, 30, 30)), solid_image(40, 40, (30, 30, 200))]
    grid_hwc = np.asarray(make_image_grid(images, ["WWW ||| reward 1.000", ""], num_columns=2))
    band_first = grid_hwc[40:, :40]
    band_second = grid_hwc[40:, 40 + GRID_GAP :]
    assert (band_first != WHITE).any(axis=-1).sum() > 20  # drawn glyphs
    assert (band_second == WHITE).all()


def test_grid_single_image_and_default_columns():
    image = noise_image(24, 16, seed=0)
    grid = make_image_grid([image], ["only"], num_columns=4)  # 4 columns for 1 image -> clamped to 1
    assert grid.size == (24, 16 + caption_band_height(24))
    np.testing.assert_array_equal(np.asarray(grid)[:16], np.asarray(image))
    # Default columns: ceil(sqrt(5)) = 3.
    grid5 = make_image_grid([image] * 5, [""] * 5)
    assert grid5.width == 3 * 24 + 2 * GRID_GAP


def test_grid_fits_images_of_different_sizes_into_the_cell():
    blue, red = (0, 0, 255), (255, 0, 0)
    images = [solid_image(64, 32, blue), solid_image(40, 80, red), solid_image(10, 5, blue).convert("L")]
    grid = make_image_grid(images, ["wide", "tall", "grey"], num_columns=3, cell_size=32)
    # Cells take images[0]'s aspect ratio with a longer side of 32: 32 x 16.
    band = caption_band_height(32)
    assert grid.size == (3 * 32 + 2 * GRID_GAP, 16 + band)
    grid_hwc = np.asarray(grid).astype(int)
    # 64x32 -> 32x16 fills its cell.
    assert np.abs(grid_hwc[:16, :32] - blue).max() <= 1
    # 40x80 into 32x16: scale min(32/40, 16/80) = 0.2 -> 8x16, centred at x = (32 - 8) // 2 = 12.
    cell = grid_hwc[:16, 36 : 36 + 32]
    assert np.abs(cell[:, 12:20] - red).max() <= 1
    assert (cell[:, :12] == 255).all() and (cell[:, 20:] == 255).all()
    # A grey-scale 10x5 image is upscaled to 32x16 and converted to RGB.
    assert grid_hwc[8, 2 * 36 + 16].tolist() == [29, 29, 29]  # L of pure blue: 0.114 * 255 = 29.07


def test_grid_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one image"):
        make_image_grid([], [])
    with pytest.raises(ValueError, match="2 images and 1 captions"):
        make_image_grid([solid_image(8, 8, (0, 0, 0))] * 2, ["one"])
    with pytest.raises(ValueError, match="num_columns"):
        make_image_grid([solid_image(8, 8, (0, 0, 0))], ["a"], num_columns=0)
    with pytest.raises(TypeError, match="Image.fromarray"):
        make_image_grid([np.zeros((8, 8, 3), dtype=np.uint8)], ["a"])


def test_wrap_keeps_lines_within_width_and_marks_truncation():
    font = ImageFont.load_default(size=10)
    text = (
        "a photograph of an astronaut riding a horse on the moon, 8k, highly detailed, supercalifragilistic"
    )
    lines = wrap_text(text, font, width=60, max_lines=3)
    assert len(lines) == 3
    assert all(font.getlength(line) <= 60 for line in lines)
    assert lines[-1].endswith("...")
    assert " ".join(lines[:2]) == text[: len(" ".join(lines[:2]))]  # lines are the text's start, in order
    # A word wider than the line is split instead of overflowing; short text stays whole.
    assert all(
        font.getlength(line) <= 20 for line in wrap_text("abcdefghijklmnop", font, width=20, max_lines=9)
    )
    assert wrap_text("a cat", font, width=60, max_lines=3) == ["a cat"]


def test_long_caption_loses_its_prompt_end_not_its_reward():
    font = ImageFont.load_default(size=10)
    text = caption("a photograph of an astronaut riding a horse on the moon, 8k, highly detailed", 0.7314)
    lines = _wrap_caption(text, font, width=124, max_lines=3)
    assert len(lines) == 3 and all(font.getlength(line) <= 124 for line in lines)
    assert lines[-1] == "| reward 0.731" and lines[-2].endswith("...")
    assert lines[0].startswith("a photograph")
    # A caption that fits is wrapped as plain text.
    assert _wrap_caption("a cat | reward 0.731", font, width=124, max_lines=3) == ["a cat | reward 0.731"]


# --- TensorBoard ------------------------------------------------------------------------------------------


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_scalars_images_and_text_read_back(tmp_path):
    tracker = build_tracker(is_main=True, output_dir=tmp_path, run_name="tb", config={"lr": 1e-4})
    assert isinstance(tracker, TensorBoardTracker)
    for step in (1, 2, 3):
        tracker.log_scalars(
            step,
            {
                "loss": 0.5 * step,
                "reward_mean": torch.tensor(-float(step)),
                "lr": np.float32(0.25),
                "kl": float("nan"),  # skipped
                "note": "text",  # skipped
                "vector": torch.ones(2),  # skipped
            },
        )
    images = [noise_image(20, 20, seed) for seed in range(3)]
    captions = [caption(f"prompt {i} | with a bar", 0.1 * i) for i in range(3)]
    tracker.log_images(2, "samples", images, captions)
    tracker.close()
    tracker.close()  # idempotent
    tracker.log_scalars(4, {"loss": 9.0})  # after close: ignored, no crash
    tracker.log_images(4, "samples", images, captions)

    events = read_events(tmp_path / "tensorboard")
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr", "reward_mean"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, -1.0), (2, -2.0), (3, -3.0)]
    assert events.Scalars("lr")[0].value == 0.25

    (image_event,) = events.Images("samples")
    assert image_event.step == 2
    decoded = Image.open(io.BytesIO(image_event.encoded_image_string))
    assert decoded.format == "PNG"
    expected = make_image_grid(images, captions)
    assert decoded.size == expected.size == (2 * 20 + GRID_GAP, 2 * (20 + caption_band_height(20)) + GRID_GAP)
    np.testing.assert_array_equal(np.asarray(decoded.convert("RGB")), np.asarray(expected))

    (text_tag,) = [tag for tag in events.Tags()["tensors"] if tag.startswith("samples/captions")]
    (text_event,) = events.Tensors(text_tag)
    markdown = text_event.tensor_proto.string_val[0].decode()
    assert markdown == captions_markdown(captions)
    assert "| 1 | prompt 1 \\| with a bar \\| reward 0.100 |" in markdown


def test_non_main_rank_and_no_backend_create_no_files(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # other ranks must not even import wandb
    out = tmp_path / "rank1"
    tracker = build_tracker(is_main=False, output_dir=out, run_name="r", config={}, wandb=True)
    assert isinstance(tracker, NullTracker)
    tracker.log_scalars(1, {"loss": 1.0})
    tracker.log_images(1, "samples", [solid_image(8, 8, (0, 0, 0))], ["x"])
    tracker.close()
    tracker.log_scalars(2, {"loss": 1.0})
    both_off = build_tracker(is_main=True, output_dir=out, run_name="r", config={}, tensorboard=False)
    assert isinstance(both_off, NullTracker)
    assert not out.exists()


def test_missing_wandb_or_bad_mode_is_a_clear_error_before_any_file(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="wandb_mode"):
        build_tracker(
            is_main=True, output_dir=tmp_path / "a", run_name="r", config={}, wandb=True, wandb_mode="on"
        )
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` does when it is not installed
    with pytest.raises(TrackerError, match=r"pip install wandb.*logging\.wandb=false"):
        build_tracker(is_main=True, output_dir=tmp_path / "b", run_name="r", config={}, wandb=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_log_images_rejects_mismatched_captions(tmp_path):
    with build_tracker(is_main=True, output_dir=tmp_path, run_name="r", config={}) as tracker:
        with pytest.raises(ValueError, match="one caption per image"):
            tracker.log_images(1, "samples", [solid_image(8, 8, (0, 0, 0))], [])
    assert tracker.closed


# --- Weights & Biases (offline, no network) ---------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    yield wandb
    # Stop wandb's service process so that pytest exits promptly.
    wandb.teardown()


def test_wandb_offline_run_with_tensorboard_and_resume(tmp_path, wandb_offline):
    out = tmp_path / "run"
    images = [noise_image(16, 16, seed) for seed in range(3)]
    captions = [caption(f"prompt {i}", float(i)) for i in range(3)]
    tracker = build_tracker(
        is_main=True,
        output_dir=out,
        run_name="offline-test",
        config={"algo": {"beta": 0.04}},
        wandb=True,
        wandb_mode="offline",
    )
    assert isinstance(tracker, MultiTracker)
    assert [type(t) for t in tracker.trackers] == [TensorBoardTracker, WandbTracker]
    for step in (1, 2):
        tracker.log_scalars(step, {"reward_mean": -3.9 + 0.1 * step, "kl": math.inf})
    tracker.log_images(2, "samples", images, captions)
    tracker.close()
    tracker.log_scalars(3, {"reward_mean": 0.0})  # after close: ignored, no crash

    run_id = (out / "wandb" / "run_id.txt").read_text().strip()
    (run_dir,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    run_file = run_dir / f"run-{run_id}.wandb"
    assert run_file.stat().st_size > 0
    assert b"reward_mean" in run_file.read_bytes()  # the history records name the logged key
    assert len(list((run_dir / "files" / "media" / "images").glob("*.png"))) == len(images)
    assert [e.step for e in read_events(out / "tensorboard").Scalars("reward_mean")] == [1, 2]

    # Continuing in the same output directory reopens the same W&B run id.
    again = build_tracker(
        is_main=True,
        output_dir=out,
        run_name="offline-test",
        config={},
        tensorboard=False,
        wandb=True,
        wandb_mode="offline",
    )
    assert isinstance(again, WandbTracker)
    again.log_scalars(3, {"reward_mean": -3.5})
    again.close()
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1
    assert (out / "wandb" / "run_id.txt").read_text().strip() == run_id


@pytest.mark.parametrize(
    ("config", "label"),
    [
        ("t2i_training", "dit flow_grpo"),
        ("nft_training", "dit nft"),
        ("ar_training", "ar grpo"),
        ("joint_training", "joint grpo + flow_grpo"),
    ],
)
def test_the_progress_bar_names_the_half_and_its_algorithm(config, label):
    from glm_training.config import load_config
    from glm_training.engine.reporting import progress_label

    assert progress_label(load_config([], config)) == label

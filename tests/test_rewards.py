"""Rewards: registry errors, JPEG sizes, the OCR reward on PIL-rendered text, RewardSet arithmetic."""

from __future__ import annotations

import io
import math
import threading
import time
from concurrent import futures

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from glm_training.rewards import Reward, RewardSet, available_rewards, build_reward, register_reward
from glm_training.rewards.ocr import levenshtein, normalize_text, ocr_score, quoted_text, target_text


def render_text(text: str, size: tuple[int, int] = (512, 128), font_size: int = 56) -> Image.Image:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((20, 30), text, fill="black", font=ImageFont.load_default(size=font_size))
    return image


def noise_image(seed: int = 0, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


# --------------------------------------------------------------------------- registry


def test_builtin_rewards_are_registered():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "ocr"} <= set(available_rewards())


def test_unknown_name_lists_available_and_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'jpeg_compressibility'") as info:
        build_reward("jpeg_compressability")
    for name in available_rewards():
        assert name in str(info.value)


def test_unknown_option_is_named_before_building():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['qualty'\].*quality"):
        build_reward("jpeg_compressibility", qualty=90)


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="'ocr' is already registered"):

        @register_reward("ocr")
        class AnotherOcr(Reward):
            def __call__(self, images, prompts, metadata):
                return torch.zeros(len(images))


def test_register_requires_reward_subclass():
    with pytest.raises(TypeError, match="Reward subclass"):
        register_reward("test_not_a_reward")(object)


# --------------------------------------------------------------------------- jpeg


def test_jpeg_compressibility_matches_independent_encoding():
    images = [Image.new("RGB", (64, 64), (120, 30, 200)), noise_image()]
    scores = build_reward("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    assert scores.shape == (2,) and scores.dtype == torch.float32 and scores.device.type == "cpu"
    expected = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=95)
        expected.append(-len(buffer.getvalue()) / 1000)  # DDPO: kB = 1000 bytes
    torch.testing.assert_close(scores, torch.tensor(expected), rtol=0, atol=1e-6)
    assert scores[0] > scores[1]  # flat image compresses better than noise

    incompressibility = build_reward("jpeg_incompressibility")(images, ["a", "b"], [{}, {}])
    torch.testing.assert_close(incompressibility, -scores, rtol=0, atol=0)


def test_jpeg_is_deterministic_and_converts_to_rgb():
    image = noise_image(seed=1).convert("RGBA")
    reward = build_reward("jpeg_compressibility")
    first = reward([image], ["p"], [{}])
    torch.testing.assert_close(first, reward([image.convert("RGB")], ["p"], [{}]), rtol=0, atol=0)


# --------------------------------------------------------------------------- text helpers


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("", "abc", 3),  # 3 insertions
        ("abc", "", 3),
        ("abc", "abc", 0),
        ("intention", "execution", 5),  # the textbook example (Jurafsky & Martin), unit costs
        ("ab", "ba", 2),  # no transpositions: two substitutions
    ],
)
def test_levenshtein_golden(a, b, distance):
    assert levenshtein(a, b) == distance
    assert levenshtein(b, a) == distance


def test_normalize_text():
    assert normalize_text("  Hello \n  WORLD ") == "hello world"
    assert normalize_text("ＧＬＭ：Image") == "glm:image"  # full-width forms fold to ASCII (NFKC)


def test_quoted_text_patterns_in_prompt_order():
    assert quoted_text("a sign that says 'OPEN'") == "OPEN"
    assert quoted_text('a sign that says "OPEN"') == "OPEN"
    assert quoted_text("a sign that says \u201cOPEN\u201d") == "OPEN"
    assert quoted_text("a sign that says 「开放」") == "开放"
    assert quoted_text("\u201cfirst\u201d then 'second' then \"third\"") == "first second third"
    assert quoted_text('a poster saying "Don\'t stop"') == "Don't stop"
    assert quoted_text("no quotes here") == ""
    assert quoted_text('empty "" quotes') == ""


def test_ocr_score_arithmetic():
    assert ocr_score("Hello  World", "hello world") == 1.0
    # "helo world" vs "hello world": 1 insertion over 11 characters
    assert ocr_score("helo world", "hello world") == pytest.approx(1 - 1 / 11)
    assert ocr_score("", "hello") == 0.0
    assert ocr_score("a much longer unrelated string", "hi") == 0.0  # distance clipped at len(target)


def test_metadata_text_overrides_quotes():
    assert target_text('a sign that says "OPEN"', {"text": "Closed"}) == "closed"
    assert target_text('a sign that says "OPEN"', {}) == "open"


# --------------------------------------------------------------------------- ocr model


@pytest.fixture(scope="module")
def ocr_reward():
    return build_reward("ocr")


def test_ocr_exact_misspelled_and_blank(ocr_reward):
    prompt = 'a white poster with the words "Hello World"'
    images = [render_text("Hello World"), render_text("Hellp Wrld"), Image.new("RGB", (512, 128), "white")]
    start = time.process_time()  # CPU time, which other load on the machine does not inflate
    scores = ocr_reward(images, [prompt] * 3, [{}] * 3)
    seconds_per_image = (time.process_time() - start) / len(images)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert scores[0].item() == 1.0
    assert 0.0 < scores[1].item() < 1.0
    assert scores[2].item() == 0.0
    assert seconds_per_image < 2.0, f"OCR took {seconds_per_image:.2f} CPU s per 512x128 image"


def test_ocr_metadata_text_overrides_prompt_quotes(ocr_reward):
    image = render_text("GLM")
    scores = ocr_reward([image, image], ['a logo reading "XYZ"'] * 2, [{"text": "GLM"}, {}])
    assert scores[0].item() == 1.0
    assert scores[1].item() == 0.0  # "glm" vs "xyz": 3 substitutions over 3 characters


def test_ocr_reads_tiny_images(ocr_reward):
    # A 48x48 image (tiny-model resolution) is upscaled to min_side before detection.
    image = render_text("OK", size=(192, 192), font_size=110).resize((48, 48), Image.Resampling.BICUBIC)
    assert ocr_reward([image], ["'OK'"], [{}]).item() == 1.0


def test_ocr_check_prompts_names_prompt(ocr_reward):
    ocr_reward.check_prompts(['a sign "OPEN"', "a plain cat"], [{}, {"text": "meow"}])
    with pytest.raises(ValueError, match=r"prompt 1 \('a plain dog'\).*add quotes around the text"):
        ocr_reward.check_prompts(['a sign "OPEN"', "a plain dog"], [{}, {}])


# --------------------------------------------------------------------------- RewardSet


@register_reward("test_constant_reward")
class ConstantReward(Reward):
    """Scores image i as `offset + i`; `bad` makes it return a broken output."""

    def __init__(self, offset: float = 0.0, bad: str = "") -> None:
        self.offset = offset
        self.bad = bad

    def __call__(self, images, prompts, metadata):
        scores = self.offset + torch.arange(len(images), dtype=torch.float32)
        if self.bad == "shape":
            return scores[:, None]
        if self.bad == "nan":
            scores[1] = float("nan")
        return scores


def test_reward_set_weighted_sum():
    images = [Image.new("RGB", (32, 32), "white"), noise_image(size=32)]
    reward_set = RewardSet(
        {"test_constant_reward": 2.0, "jpeg_compressibility": -0.5},
        options={"test_constant_reward": {"offset": 1.0}},
    )
    assert reward_set.names == ["test_constant_reward", "jpeg_compressibility"]
    raw = reward_set(images, ["a", "b"], [{}, {}])
    total = reward_set.combine(raw, num_generations=2)
    jpeg = raw["jpeg_compressibility"]
    torch.testing.assert_close(raw["test_constant_reward"], torch.tensor([1.0, 2.0]))
    # total_i = 2 * (1 + i) - 0.5 * jpeg_i
    expected = torch.tensor([2.0 * 1.0 - 0.5 * jpeg[0].item(), 2.0 * 2.0 - 0.5 * jpeg[1].item()])
    torch.testing.assert_close(total, expected)
    assert total.dtype == torch.float32 and total.shape == (2,)


@pytest.mark.parametrize(("bad", "message"), [("shape", "shape"), ("nan", "non-finite")])
def test_reward_set_rejects_broken_output(bad, message):
    reward_set = RewardSet({"test_constant_reward": 1.0}, options={"test_constant_reward": {"bad": bad}})
    with pytest.raises(ValueError, match=f"'test_constant_reward'.*{message}"):
        reward_set([Image.new("RGB", (8, 8))] * 2, ["a", "b"], [{}, {}])


def test_reward_set_validates_config():
    with pytest.raises(ValueError, match="at least one reward"):
        RewardSet({})
    with pytest.raises(ValueError, match="Did you mean 'ocr'"):
        RewardSet({"jpeg_compressibility": 1.0, "ocrr": 1.0})
    with pytest.raises(ValueError, match="finite"):
        RewardSet({"jpeg_compressibility": float("inf")})
    with pytest.raises(ValueError, match=r"\['ocr'\] that have no weight"):
        RewardSet({"jpeg_compressibility": 1.0}, options={"ocr": {"use_det": False}})
    with pytest.raises(ValueError, match="unknown option"):
        RewardSet({"ocr": 1.0}, options={"ocr": {"use_dett": False}})


# --------------------------------------------------------------------------- combining


def test_normalized_sum_against_hand_arithmetic():
    from glm_training.rewards.combine import normalized_sum, weighted_sum

    # Two groups of K=2. Reward a: group 0 = [1, 3] -> mean 2, std 1 -> z = [-1, 1];
    # group 1 = [5, 5] -> flat -> z = [0, 0]. Reward b: group 0 = [10, 30] -> z = [-1, 1];
    # group 1 = [0, 40] -> mean 20, std 20 -> z = [-1, 1].
    parts = {"a": torch.tensor([1.0, 3.0, 5.0, 5.0]), "b": torch.tensor([10.0, 30.0, 0.0, 40.0])}
    weights = {"a": 2.0, "b": 0.5}
    total = normalized_sum(parts, weights, num_generations=2, eps=0.0)
    # total = 2 * z_a + 0.5 * z_b = [-2.5, 2.5, -0.5, 0.5]
    torch.testing.assert_close(total, torch.tensor([-2.5, 2.5, -0.5, 0.5]))
    # The weighted sum: 2 * a + 0.5 * b = [7, 21, 10, 30]
    torch.testing.assert_close(weighted_sum(parts, weights, 2), torch.tensor([7.0, 21.0, 10.0, 30.0]))
    # Scale invariance: multiplying a reward by 1000 does not change the normalised total.
    scaled = {"a": parts["a"] * 1000.0, "b": parts["b"]}
    torch.testing.assert_close(normalized_sum(scaled, weights, 2, eps=0.0), total)


def gdpo_advantages(rewards_nk: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """NVlabs/GDPO at b080e63, `trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py` lines 1221-1245 (the
    `apply_gdpo` branch): each reward standardised in its group with torch's default (unbiased) std, the
    weighted sum, then the batch mean and unbiased std of the sum."""
    per_reward = []
    for i in range(len(weights)):
        reward_i = torch.nan_to_num(rewards_nk)[:, i]
        mean = reward_i.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations, dim=0)
        std = reward_i.view(-1, num_generations).std(dim=1).repeat_interleave(num_generations, dim=0)
        per_reward.append((reward_i - mean) / (std + 1e-4))
    pre_bn = (torch.stack(per_reward, dim=1) * weights.unsqueeze(0)).nansum(dim=1)
    return (pre_bn - pre_bn.mean()) / (pre_bn.std() + 1e-4)


@pytest.mark.parametrize("num_groups, num_generations", [(4, 4), (8, 16), (3, 24)])
def test_normalized_sum_with_batch_scaling_is_gdpo_up_to_the_std_estimator(num_groups, num_generations):
    """`reward.combine=normalized_sum` with `algo.scale_rewards=batch` is GDPO's advantage (arXiv 2601.05242).
    The one difference is the estimator of the std: GDPO divides by torch's unbiased stds, this project by
    population stds (as Flow-GRPO's np.std). Inside the groups that scales every reward by the same
    sqrt((K - 1) / K), which the batch step divides out; over the batch it leaves ours larger by
    sqrt(N / (N - 1)), N = G * K, a constant factor (an lr change of 0.2-3% here). Bound: eps = 1e-4 is added
    to stds of different sizes on the two sides, 1e-3 relative."""
    from glm_training.engine.advantages import batch_std_advantages
    from glm_training.rewards.combine import normalized_sum

    generator = torch.Generator().manual_seed(num_groups * num_generations)
    n = num_groups * num_generations
    parts = {
        "ocr": torch.rand(n, generator=generator),
        "aesthetic": 5 + 2 * torch.randn(n, generator=generator),
    }
    parts["ocr"][:num_generations] = 0.5  # a flat group in one reward: 0 from it, in both
    weights = {"ocr": 1.0, "aesthetic": 0.3}
    total = normalized_sum(parts, weights, num_generations)
    ours = batch_std_advantages(total.view(num_groups, num_generations)).reshape(-1)
    theirs = gdpo_advantages(
        torch.stack([parts["ocr"], parts["aesthetic"]], dim=1), torch.tensor([1.0, 0.3]), num_generations
    )
    torch.testing.assert_close(ours * math.sqrt((n - 1) / n), theirs, rtol=1e-3, atol=1e-5)
    assert not torch.allclose(ours, theirs, rtol=1e-4, atol=0)  # the factor is there, and measurable


def test_reward_set_combine_modes():
    with pytest.raises(ValueError, match="unknown reward combination 'mean'"):
        RewardSet({"jpeg_compressibility": 1.0}, combine="mean")
    reward_set = RewardSet({"jpeg_compressibility": 1.0}, combine="normalized_sum")
    images = [noise_image(seed=i, size=16 + 8 * i) for i in range(4)]
    parts = reward_set(images, list("abcd"), [{}] * 4)
    total = reward_set.combine(parts, num_generations=2)
    # Each group of two normalises to (-1, +1) up to eps, in the order of the raw scores.
    assert torch.allclose(total.abs(), torch.ones(4), atol=1e-3)
    assert torch.equal(total.view(2, 2).argmax(1), parts["jpeg_compressibility"].view(2, 2).argmax(1))


@register_reward("test_gated_reward")
class GatedReward(Reward):
    """Scores each image by its width once the test opens the gate for the call; records the thread."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)  # released as each call starts
        self.gate = threading.Semaphore(0)  # released by the test, once per call
        self.threads: list[str] = []

    def __call__(self, images, prompts, metadata):
        self.threads.append(threading.current_thread().name)
        self.started.release()
        if not self.gate.acquire(timeout=60):  # a guard against a hang, never reached when the test is right
            raise TimeoutError("the test never opened the gate")
        return torch.tensor([float(img.width) for img in images])


@pytest.mark.parametrize("overlap", [False, True])
def test_scoring_queue_keeps_order_and_overlaps(overlap):
    reward_set = RewardSet({"test_gated_reward": 1.0})
    reward = reward_set.rewards["test_gated_reward"]
    queue = reward_set.queue(overlap=overlap)
    for width in (8, 16, 24):
        if not overlap:
            reward.gate.release()  # scored inside submit, in this thread
        queue.submit([Image.new("RGB", (width, 8)), Image.new("RGB", (width + 1, 8))], ["p", "q"], [{}, {}])
        if overlap:
            # submit returned before the chunk's scoring could end (it waits for the gate, opened only
            # now): scoring runs beside the caller, who goes on with the rollout of the next chunk.
            assert reward.started.acquire(timeout=60)
            reward.gate.release()
        else:
            assert reward.started.acquire(blocking=False)  # already scored when submit returned
    scores = queue.result()["test_gated_reward"]
    reward_set.close()
    torch.testing.assert_close(scores, torch.tensor([8.0, 9.0, 16.0, 17.0, 24.0, 25.0]))
    if overlap:
        assert len(reward.threads) == 3 and all(t.startswith("reward") for t in reward.threads)
    else:
        assert reward.threads == ["MainThread"] * 3


def test_scoring_queue_fails_fast_and_drops_the_queued_chunks():
    reward_set = RewardSet({"test_constant_reward": 1.0}, options={"test_constant_reward": {"bad": "nan"}})
    queue = reward_set.queue(overlap=True)
    queue.submit([Image.new("RGB", (8, 8))] * 2, ["a", "b"], [{}, {}])
    futures.wait(queue._pending)  # the worker has scored (and failed on) the first chunk
    # The next submit, not the end of the rollout, raises the first chunk's error.
    with pytest.raises(ValueError, match="'test_constant_reward' returned non-finite"):
        queue.submit([Image.new("RGB", (8, 8))] * 2, ["c", "d"], [{}, {}])
    assert queue._pending == []
    reward_set.close()


def test_scoring_queue_reraises_a_reward_error():
    reward_set = RewardSet({"test_constant_reward": 1.0}, options={"test_constant_reward": {"bad": "nan"}})
    queue = reward_set.queue(overlap=True)
    queue.submit([Image.new("RGB", (8, 8))] * 2, ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="'test_constant_reward' returned non-finite"):
        queue.result()
    reward_set.close()


# --------------------------------------------------------------------------- user reward functions


@pytest.fixture
def user_rewards_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))


def test_user_function_reward(user_rewards_on_path):
    name = "user_rewards.brightness:mean_brightness"
    reward_set = RewardSet({name: 1.0, "jpeg_compressibility": 0.0}, options={name: {"scale": 2.0}})
    images = [Image.new("RGB", (8, 8), (255, 255, 255)), Image.new("RGB", (8, 8), (0, 0, 0))]
    parts = reward_set(images, ["a", "b"], [{}, {}])
    # scale 2 x brightness: white = 2 * 1.0, black = 0.
    torch.testing.assert_close(parts[name], torch.tensor([2.0, 0.0]))


def test_user_function_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def width(images, prompts, metadata):\n    return [im.width for im in images]\n")
    reward_set = RewardSet({f"{path}:width": 1.0})
    parts = reward_set([Image.new("RGB", (5, 8)), Image.new("RGB", (7, 8))], ["a", "b"], [{}, {}])
    torch.testing.assert_close(parts[f"{path}:width"], torch.tensor([5.0, 7.0]))


def test_user_function_with_wrong_shape_fails_on_first_batch_naming_it(user_rewards_on_path):
    name = "user_rewards.brightness:one_score_for_all"
    reward_set = RewardSet({name: 1.0})
    with pytest.raises(ValueError, match=rf"reward '{name}' returned shape \(1,\) for 2 images.*one score"):
        reward_set([Image.new("RGB", (8, 8))] * 2, ["a", "b"], [{}, {}])


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("user_rewards.nope:f", {}, "cannot import module 'user_rewards.nope'"),
        ("user_rewards.brightness:missing", {}, "has no 'missing'.*mean_brightness"),
        ("user_rewards.brightness:NOT_CALLABLE", {}, "not a function"),
        ("user_rewards.brightness:mean_brightness", {"scal": 1.0}, "cannot be called.*scal"),
        ("/no/such/file.py:f", {}, "does not exist"),
    ],
)
def test_user_function_errors_at_start_up(user_rewards_on_path, name, options, message):
    with pytest.raises(ValueError, match=message):
        RewardSet({name: 1.0}, options={name: options} if options else None)

"""`python -m glm_training.gpu_check --toy` on the CPU: every stage runs and lands in the reports, and a run
killed part way keeps the stages it finished.

The toy keeps GLM-Image's real widths with one layer per stack, so this also proves that the meta-device
build, the roofline arithmetic and the in-memory trainers work at real sizes; the figures themselves are
checked only for being real (finite, positive), not for their values.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from glm_training import gpu_check
from glm_training.gpu_check.settings import default_recipes
from glm_training.pipeline.ar import DECODING_PATHS

pytestmark = pytest.mark.slow


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _lines(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "gpu_check.jsonl").read_text().splitlines()]


def test_toy_run_on_the_cpu_writes_every_section(tmp_path):
    # One batch size and one decoding path (the paths give the same tokens: tests/test_ar_logprobs.py). One
    # torch thread, the suite's (conftest.py): the other cores run the other test workers.
    # The recipes section with one recipe the dit section does not train (CFG-free, another objective).
    argv = ["--device", "cpu", "--toy", "--batch-sizes", "1", "--decoding", "loop", "--output", str(tmp_path)]
    argv += ["--recipes", "nft_ocr:sampling.num_steps=3"]
    assert gpu_check.main(argv) == 0

    # One line a stage, in the order of value, each complete JSON written when its stage ended.
    lines = _lines(tmp_path)
    sections = [line["section"] for line in lines]
    assert sections == [
        "environment",
        "seeds",
        "build",
        "dit",
        "ar",
        "recipes",
        "decoding",
        "decoding",
        "pipeline",
    ]
    assert all(line["ok"] and _positive(line["seconds"]) for line in lines)
    assert [line["wall_seconds"] for line in lines] == sorted(line["wall_seconds"] for line in lines)

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["errors"] == []
    env = report["environment"]
    assert env["cpu_model"] and set(env["versions"]) == set(gpu_check.PACKAGES)
    assert _positive(report["bandwidth"]["bytes_per_s"]) and _positive(report["matmul"]["flops_per_s"])
    build = report["build"]
    assert build["ar_logits"]["finite"] and _positive(build["params"]["vision_language_encoder"])
    assert lines[2]["result"]["params"] == build["params"]

    assert [c["seed"] for c in report["checks"]] == ["000", "001", "002", "003"]
    assert all(c["passed"] for c in report["checks"]), report["checks"]
    assert lines[1]["result"]["checks"] == report["checks"]

    for component in ("dit", "ar"):
        step = report["training"][component]
        assert step["samples"] == 2 and math.isfinite(step["loss"])
        assert _positive(step["step_seconds"]) and _positive(step["peak_memory_gib"])
        assert all(_positive(step["phases"][phase]["seconds"]) for phase in ("rollout", "update"))
        assert _positive(step["plan_peak_gib"]) and _positive(step["trainable_params"])
    assert _positive(report["training"]["dit"]["update_flops"])

    (row,) = report["recipes"]  # the recipe's micro-batch of 3, its own algorithm, the override last
    assert (row["recipe"], row["spec"], row["samples"], row["num_steps"]) == (
        "recipes/nft_ocr",
        "nft_ocr:sampling.num_steps=3",
        3,
        1,
    )
    phases = row["phases"]
    assert row["images_per_s"] == 3 / (phases["rollout"]["seconds"] + phases["update"]["seconds"]) > 0
    assert math.isfinite(row["loss"])

    (rollout,) = report["decoding"]  # the eager loop at batch 1; --compile is off by default on a CPU
    assert (rollout["decoding"], rollout["batch"], rollout["num_steps"]) == ("loop", 1, 8)
    assert report["run"]["decoding_paths"] == ["loop"] and report["run"]["compile"] is False
    assert all(_positive(rollout[k]) for k in ("step_ms", "tokens_per_s", "roofline_tokens_per_s", "ratio"))
    assert rollout["bytes_per_step"]["total"] > rollout["bytes_per_step"]["weights"] > 0

    (call,) = report["pipeline"]  # 64x64 only
    assert (call["height"], call["width"], call["decoding"]) == (64, 64, "loop") and call["finite"]
    # 64x64: the 16x16 preview grid, the 2x2 large grid and the closing token.
    assert call["ar_tokens"] == 256 + 4 + 1
    assert all(_positive(call[k]) for k in ("ar_seconds", "dit_seconds", "peak_memory_gib"))

    markdown = (tmp_path / "gpu_check.md").read_text()
    headings = ("Targets", "Seed checks", "One LoRA training step", "Images per GPU-second", "AR decoding")
    for heading in (*headings, "Text to image"):
        assert f"#### {heading}" in markdown
    assert "Stage errors" not in markdown
    assert markdown.count("| pass |") == 4
    assert "step peak within 15% of the plan" in markdown  # the targets measured so far
    rows = [line for line in markdown.splitlines() if line.startswith("| 64x64 |")]
    assert len(rows) == 2  # the decoding row and the text-to-image call


def test_defaults_and_settings_errors():
    real = gpu_check.parse_settings(["--device", "cpu"])
    assert (real.sizes, real.batch_sizes, real.decode_steps, real.train_size) == ((1024,), (1, 16), 128, 1024)
    assert real.sections == gpu_check.SECTIONS and real.decoding_paths == tuple(DECODING_PATHS)
    # Per algorithm its OCR recipes, or its first (the AR half's): no PickScore variant, GSPO or joint run.
    assert real.recipes == default_recipes()
    assert set(real.recipes) == {
        "flow_grpo_fast_ocr",
        "flow_grpo_ocr",
        "nft_ocr",
        "awm_ocr",
        "dgpo_ocr",
        "dapo_aesthetic_alignment",
    }
    assert real.compile is False  # on by default on CUDA only
    picked = gpu_check.parse_settings(["--device", "cpu", "--sections", "pipeline", "seeds", "--compile"])
    assert picked.sections == ("seeds", "pipeline") and picked.compile  # always in the order of value
    for argv in (["--sizes", "100"], ["--decode-steps", "1"], ["--sections", "everything"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_settings(["--device", "cpu", "--toy", *argv])


# A run stopped at its time limit, as SIGKILL stops it: here deterministically, at the start of the stage
# after the seed checks (the build), instead of after some number of seconds.
KILLED_IN_THE_BUILD = textwrap.dedent(
    """
    import os, signal, sys
    from glm_training.gpu_check import cli as gpu_check  # main looks build_pipeline up in cli

    def killed(settings):
        os.kill(os.getpid(), signal.SIGKILL)

    gpu_check.build_pipeline = killed
    sys.exit(gpu_check.main(sys.argv[1:]))
    """
)


def test_a_run_killed_part_way_keeps_the_stages_it_finished(tmp_path):
    argv = ["--device", "cpu", "--toy", "--sections", "seeds", "dit", "--output", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_IN_THE_BUILD, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "build the model" in proc.stderr  # it was killed in the stage after the seed checks
    lines = _lines(tmp_path)
    assert [line["section"] for line in lines] == ["environment", "seeds"]
    assert lines[0]["result"]["environment"]["device"] == "cpu"
    assert [c["seed"] for c in lines[1]["result"]["checks"]] == ["000", "001", "002", "003"]
    assert all(c["passed"] for c in lines[1]["result"]["checks"])
    # The summary files hold the same finished stages.
    assert len(json.loads((tmp_path / "gpu_check.json").read_text())["checks"]) == 4
    assert (tmp_path / "gpu_check.md").read_text().count("| pass |") == 4

"""`python -m glm_training.gpu_check --toy` on the CPU: every stage runs and lands in both reports.

The toy keeps GLM-Image's real widths with one layer per stack, so this also proves that the meta-device
build, the roofline arithmetic and the in-memory trainers work at real sizes; the figures themselves are
checked only for being real (finite, positive), not for their values.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from glm_training import gpu_check
from glm_training.rollout.ar import DECODING_PATHS

pytestmark = pytest.mark.slow


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_toy_run_on_the_cpu_writes_every_section(tmp_path):
    # Real widths: AR decoding reads ~0.5 GB of weights a token, and two threads halve the time of one (the
    # suite's default, conftest.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        # One batch size and one decoding path: each real-width rollout takes ~8 s on 2 cores (the paths give
        # the same tokens: tests/test_ar_logprobs.py).
        argv = [
            "--device",
            "cpu",
            "--toy",
            "--batch-sizes",
            "1",
            "--decoding",
            "loop",
            "--output",
            str(tmp_path),
        ]
        assert gpu_check.main(argv) == 0
    finally:
        torch.set_num_threads(threads)

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["errors"] == []
    env = report["environment"]
    assert env["cpu_model"] and set(env["versions"]) == set(gpu_check.PACKAGES)
    assert _positive(report["bandwidth"]["bytes_per_s"]) and _positive(report["matmul"]["flops_per_s"])
    build = report["build"]
    assert build["ar_logits"]["finite"] and _positive(build["params"]["vision_language_encoder"])
    assert all(stage["ok"] and _positive(stage["seconds"]) for stage in report["stages"])

    (call,) = report["pipeline"]  # 64x64 only
    assert (call["height"], call["width"]) == (64, 64) and call["finite"]
    assert _positive(call["seconds"]) and _positive(call["peak_memory_gib"])

    rollouts = {(r["decoding"], r["batch"]): r for r in report["ar_rollout"]}
    assert set(rollouts) == {("loop", 1)} and report["run"]["decoding_paths"] == ["loop"]
    # Without --decoding, every path the project has is timed.
    assert gpu_check.parse_settings(["--device", "cpu", "--toy"]).decoding_paths == tuple(DECODING_PATHS)
    for (_, batch), r in rollouts.items():
        # 64x64: the 16x16 preview grid and the 2x2 large grid, per sample.
        assert r["tokens"] == batch * (256 + 4)
        assert all(_positive(r[k]) for k in ("seconds", "tokens_per_s", "roofline_tokens_per_s", "ratio"))
        assert r["bytes_per_step"]["total"] > r["bytes_per_step"]["weights"] > 0

    for component in ("dit", "ar"):
        step = report["training"][component]
        assert step["samples"] == 2 and math.isfinite(step["loss"])
        assert _positive(step["step_seconds"]) and _positive(step["peak_memory_gib"])
        assert all(_positive(step["phases"][phase]["seconds"]) for phase in ("rollout", "update"))
        assert _positive(step["plan_peak_gib"]) and _positive(step["trainable_params"])
    assert _positive(report["training"]["dit"]["update_flops"])

    assert [c["seed"] for c in report["checks"]] == ["000", "001", "002", "003"]
    assert all(c["passed"] for c in report["checks"]), report["checks"]

    markdown = (tmp_path / "gpu_check.md").read_text()
    for heading in ("Text to image", "AR rollout", "One LoRA training step", "Seed checks"):
        assert f"#### {heading}" in markdown
    assert "Stage errors" not in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| 64x64 |")]
    assert len(rows) == 1 + len(rollouts)  # the pipeline call and every rollout
    assert markdown.count("| pass |") == 4

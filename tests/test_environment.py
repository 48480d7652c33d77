"""The machine and the packages: the lock check reports drift, and bf16 on a CPU without it is announced.

Unit tests of `glm_training.environment`, plus one real run of `train_dit.py` on a CPU whose bf16 path is
switched off (`ONEDNN_MAX_CPU_ISA=AVX2`: oneDNN then has no bf16 instructions, and the detection says so).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import DIT_SMALL, PINNED_NUMERICS, PYTHON, REPO, run_cli
from packaging.requirements import Requirement
from packaging.version import Version

from glm_training import environment
from glm_training.config import load_config


def _write_lock(tmp_path: Path, lines: list[str]) -> Path:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# a comment line\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return lock


def test_a_lock_that_matches_reports_nothing(tmp_path):
    lock = _write_lock(tmp_path, ["torch==2.13.0", "Safe.Tensors==0.8.0  # names compare as pip does"])
    report = environment.lock_differences(lock, installed={"torch": "2.13.0+cpu", "safe_tensors": "0.8.0"})
    assert report.matches and report.lines() == []


def test_a_mismatch_is_reported_with_each_package(tmp_path):
    lock = _write_lock(tmp_path, ["torch==2.13.0", "transformers==5.23.0", "peft==0.21.2"])
    installed = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "ipython": "9.0"}
    report = environment.lock_differences(lock, installed=installed)
    assert not report.matches
    assert report.different == [("transformers", "5.23.0", "5.24.0")]
    assert report.missing == [("peft", "0.21.2")]
    assert report.extra == [("ipython", "9.0")]
    assert report.lines() == [
        "transformers: locked 5.23.0, installed 5.24.0",
        "peft: locked 0.21.2, not installed",
        "ipython: installed 9.0, not in the lock",
    ]
    # Packages beyond the lock are listed but do not fail the check (a user's own tools in the venv).
    assert environment.lock_differences(
        lock, installed={**installed, "peft": "0.21.2", "transformers": "5.23.0"}
    ).matches


def test_a_malformed_lock_line_is_an_error_that_names_it(tmp_path):
    lock = _write_lock(tmp_path, ["torch>=2.6"])
    with pytest.raises(ValueError, match="'torch>=2.6' is not a 'name==version' pin"):
        environment.read_lock(lock)


def test_the_check_command_exits_1_and_names_the_drift(tmp_path):
    # A real interpreter, the real installed packages, a lock that pins this torch one release off.
    other = f"{Version(metadata.version('torch')).release[0]}.0.0"
    lock = _write_lock(tmp_path, [f"torch=={other}", "no-such-package-xyz==1.0"])
    result = subprocess.run(
        [sys.executable, "-m", "glm_training.environment", "--lock", str(lock)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"torch: locked {other}, installed {metadata.version('torch')}" in result.stdout
    assert "no-such-package-xyz: locked 1.0, not installed" in result.stdout
    assert "./setup.sh" in result.stderr and "--relock" in result.stderr


def test_the_repository_lock_satisfies_the_project_ranges():
    # Every direct dependency is locked, at a version pyproject.toml's range admits (so `pip install -c` of
    # the lock and `pip install -e .` can never disagree), and the transformers bound keeps 5.24 out.
    pins = environment.read_lock(environment.LOCK_FILE)
    requires = [Requirement(r) for r in metadata.requires(environment.PROJECT) or []]
    assert requires, "the project is not installed (pip install -e .)"
    for req in requires:  # the extras too: ocr and wandb are in the tested set (the test extra)
        name = environment.canonical(req.name)
        assert name in pins, f"{req.name} is a dependency but not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    transformers = next(r for r in requires if r.name == "transformers")
    assert not transformers.specifier.contains("5.24.0")


def test_setup_installs_from_the_lock():
    # The README's set-up: setup.sh passes the lock to pip as constraints and checks the result.
    text = (REPO / "setup.sh").read_text(encoding="utf-8")
    assert '-c "$LOCK"' in text and "glm_training.environment" in text


# ---------------------------------------------------------------------------------------------------------
# The tests' pinned numerics (tests/conftest.py)

PROBE = (
    "import json, os, torch; from glm_training import environment; print(json.dumps({"
    "'env': {k: os.environ.get(k) for k in %r}, 'capability': torch.backends.cpu.get_cpu_capability(), "
    "'threads': torch.get_num_threads(), 'native_bf16': environment.cpu_has_native_bf16()}))"
)


@pytest.mark.skipif(
    os.environ.get("GLM_TRAINING_NATIVE_NUMERICS") == "1", reason="the CPU's own kernels, asked for"
)
def test_the_tests_and_the_processes_they_start_compute_with_the_pinned_kernels():
    # torch's kernels at AVX2 whatever the CPU has, here and in a process the tests start (they inherit the
    # variables), one thread, and no native bf16 on any CPU: the oneDNN cap takes it away, and the project's
    # detection agrees, so the bf16 tests take one path everywhere.
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    result = run_cli([PYTHON, "-c", PROBE % (tuple(PINNED_NUMERICS),)])
    assert result.returncode == 0, result.stderr[-2000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe == {"env": PINNED_NUMERICS, "capability": "AVX2", "threads": 1, "native_bf16": False}


# ---------------------------------------------------------------------------------------------------------
# bf16 on the CPU


def test_a_onednn_cap_below_bf16_counts_as_no_native_bf16(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert environment.cpu_has_native_bf16() is False
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert environment.cpu_has_native_bf16() == bool(environment.cpu_bf16_flags())


@pytest.mark.parametrize(
    ("overrides", "device", "native", "warned"),
    [
        (["trainer.mixed_precision=bf16"], "cpu", False, True),
        (["model.dtype=bfloat16"], "cpu", False, True),
        (["trainer.mixed_precision=bf16"], "cpu", True, False),
        ([], "cpu", False, False),
        (["trainer.mixed_precision=bf16"], "cuda", False, False),
    ],
)
def test_bf16_on_a_cpu_without_it_warns_with_the_fix(monkeypatch, caplog, overrides, device, native, warned):
    monkeypatch.setattr(environment, "cpu_has_native_bf16", lambda: native)
    cfg = load_config(config="t2i_training", overrides=overrides)
    with caplog.at_level(logging.WARNING, logger="glm_training"):
        assert environment.warn_if_slow_bf16(cfg, torch.device(device)) is warned
    text = caplog.text
    assert ("no native bf16" in text) is warned
    if warned:
        assert ("trainer.mixed_precision=no" in text) == ("trainer.mixed_precision=bf16" in overrides)
        assert ("model.dtype=float32" in text) == ("model.dtype=bfloat16" in overrides)


@pytest.mark.slow
def test_a_bf16_run_on_a_cpu_without_native_bf16_logs_the_warning(tiny_model_dir, tmp_path):
    # oneDNN capped at AVX2 has no bf16 instructions: the run computes bf16 the slow way, and says so first.
    out = tmp_path / "run"
    args = [*DIT_SMALL, "trainer.num_steps=1", "trainer.mixed_precision=bf16", f"trainer.output_dir={out}"]
    result = run_cli([PYTHON, "train_dit.py", *args], env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert "[cpu] trainer.mixed_precision=bf16 asks for bf16 compute" in log
    assert "Set trainer.mixed_precision=no to compute in float32" in log
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1

"""Shared test set-up: offline, one tiny GLM-Image per session, subprocess helpers for the entry points."""

from __future__ import annotations

import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

# One set of floats on every x86-64 CPU: torch's, MKL's and oneDNN's kernels capped at AVX2, MKL's
# conditional numerical reproducibility on its AVX2 code path, one OpenMP thread. CPUs otherwise round
# differently from the first step (AVX-512 vector widths, MKL's and oneDNN's per-CPU code paths, SDPA through
# MKL), and a learning margin measured on one CPU is another seed on the next. Under these variables an
# AVX-512 or AMX machine computes what an AVX2-only AMD EPYC computes (`../shared/numerics/fingerprint.py`'s
# hashes), and bf16 runs the emulated way on every CPU (`environment.cpu_has_native_bf16` honours the oneDNN
# cap). They are read when torch loads its kernels, so they are set before torch is imported, and every
# process the tests start inherits them. The product itself never sets them. `GLM_TRAINING_NATIVE_NUMERICS=1`
# runs the tests on the CPU's own kernels instead (the learning margins were measured under the pin).
PINNED_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
}
if os.environ.get("GLM_TRAINING_NATIVE_NUMERICS") != "1":
    if "torch" in sys.modules and any(os.environ.get(k) != v for k, v in PINNED_NUMERICS.items()):
        raise RuntimeError(
            "torch was imported before tests/conftest.py could pin the numerics (a pytest plugin?); set "
            + " ".join(f"{k}={v}" for k, v in PINNED_NUMERICS.items())
            + " in the environment, or GLM_TRAINING_NATIVE_NUMERICS=1 to run on the CPU's own kernels."
        )
    os.environ.update(PINNED_NUMERICS)

# An accidental download fails at once instead of hanging.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models: one intra-op thread is faster than two, and leaves a core for the other process of a
# 2-rank torchrun test.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# A DiT run small enough for a test: 32x32 images, 3 sampling steps, 2 groups of 3, no evaluation.
DIT_SMALL = [
    "trainer.progress_bar=false",
    "sampling.height=32",
    "sampling.width=32",
    "sampling.num_steps=3",
    "data.num_groups_per_step=2",
    "data.num_generations=3",
    "eval.every_n_steps=0",
]

# An AR run small enough for a test: 32x32 images, 1 DiT step to render, 2 groups of 2, no evaluation.
AR_SMALL = [
    "trainer.progress_bar=false",
    "sampling.height=32",
    "sampling.width=32",
    "sampling.dit_num_steps=1",
    "data.num_groups_per_step=2",
    "data.num_generations=2",
    "algo.micro_batch_size=2",
    "eval.every_n_steps=0",
]


# Test categories (tests/README.md). Unit: these files, which build no model (pure math, configs, tools);
# distributed: the `distributed` mark (real torchrun); integration: everything else (the tiny model, end to
# end). `pytest -m unit` runs the first kind in seconds.
UNIT_FILES = {
    "test_advantages.py",
    "test_algorithm_table.py",
    "test_cli_flags.py",
    "test_config.py",
    "test_dgpo.py",
    "test_flat_groups.py",
    "test_flow_grpo.py",
    "test_gspo.py",
    "test_import_graph.py",
    "test_losses.py",
    "test_nft.py",
    "test_sde.py",
    "test_tracking.py",
    "test_update_loop.py",
}


# The longest test files, longest first (seconds summed over a file's tests in a 2-worker run on the
# AVX2-only EPYC: 369 for test_fsdp.py down to ~40). pytest-xdist gives each worker one file at a time in
# collection order, so these go first and no worker ends on a long file started last; the order changes the
# wall time only.
LONGEST_FILES = (
    "test_fsdp.py",
    "test_dit_training.py",
    "test_joint_training.py",
    "test_ar_training.py",
    "test_gpu_check.py",
    "test_robustness_signals.py",
    "test_nft_training.py",
    "test_fsdp_policy_copies.py",
    "test_priors.py",
    "test_recipe.py",
    "test_dgpo_training.py",
    "test_evaluate.py",
    "test_accelerate_launch.py",
    "test_awm_training.py",
    "test_recipes.py",
    "test_hsdp.py",
    "test_ar_logprobs.py",
    "test_multinode.py",
    "test_sharded_checkpoints.py",
    "test_robustness_rewards.py",
    "test_plan.py",
    "test_robustness_inputs.py",
    "test_export.py",
    "test_shape_fixture.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order is kept
    for item in items:
        if "distributed" in item.keywords:
            continue
        unit = (
            item.path.name in UNIT_FILES
            and "slow" not in item.keywords
            and "tmp_path" not in item.fixturenames
        )
        item.add_marker(pytest.mark.unit if unit else pytest.mark.integration)


def pytest_report_header(config) -> list[str]:
    """The machine and the packages the run is on: the CPU (bf16 in hardware or not), and the lock check."""
    from glm_training import environment

    bf16 = (
        "native bf16 " + str(environment.cpu_bf16_flags())
        if environment.cpu_has_native_bf16()
        else "no native bf16"
    )
    return [
        f"cpu: {environment.cpu_model()}, {os.cpu_count()} cores, {bf16}, torch {torch.__version__}",
        f"packages: {environment.lock_summary()}",
        "numerics: "
        + (
            "the CPU's own kernels (GLM_TRAINING_NATIVE_NUMERICS=1)"
            if os.environ.get("GLM_TRAINING_NATIVE_NUMERICS") == "1"
            else "pinned, " + " ".join(f"{k}={v}" for k, v in PINNED_NUMERICS.items())
        ),
    ]


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory) -> Path:
    """A session-wide cache for the built models, shared by in-process code and by subprocesses (env var),
    and by every pytest-xdist worker of the session (their temporary folders share a parent): each model is
    built once, by whichever worker needs it first (`tiny.ensure_built` is safe when processes race)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "glm_cache"
    path.mkdir(exist_ok=True)
    os.environ["GLM_TRAINING_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_cache) -> Path:
    from glm_training.models.tiny import ensure_tiny_pipeline

    return ensure_tiny_pipeline()


def run_cli(args: list[str], *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root with the test environment; never hangs past `timeout`."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        args, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )


def children_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's children that have ended: what a command cost, which,
    unlike its wall time, other load on the machine does not inflate."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def torchrun(
    script: str, args: list[str], *, nproc: int = 2, timeout: float = 300, log_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """A real multi-process launch (gloo on CPU) of `script` with `args`. `log_dir`: each rank's output in
    its own files there (torchrun's --redirects), for `rank_tails`."""
    cmd = [
        PYTHON,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port=0",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=localhost:0",
        *([f"--log-dir={log_dir}", "--redirects=3"] if log_dir is not None else []),
        script,
        *args,
    ]
    return run_cli(cmd, timeout=timeout)


def rank_tails(log_dir: Path, lines: int = 30) -> str:
    """The last `lines` lines of each rank's stderr of a `torchrun(..., log_dir=)` launch: a rank that died
    natively (SIGABRT) says why there, not in the survivor's traceback."""
    tails = []
    for path in sorted(log_dir.glob("*/attempt_*/*/stderr.log")):
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
        tails.append(f"--- rank {path.parent.name} ({path}) ---\n" + "\n".join(text))
    return "\n".join(tails) or f"(no rank logs under {log_dir})"


def assert_resumed_run_matches(full: Path, part: Path, step: int) -> list[tuple[dict, dict]]:
    """A run resumed from a checkpoint ends at `step` with the uninterrupted run's weights, bit for bit, and
    the same rewards and losses at every step; returns the (uninterrupted, resumed) metrics rows."""
    from safetensors.torch import load_file

    from glm_training.metrics import read_metrics

    last = f"step-{step:06d}"
    a, b = (load_file(str(run / "checkpoints" / last / "trainable.safetensors")) for run in (full, part))
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows_full, rows_part = read_metrics(full / "metrics.jsonl"), read_metrics(part / "metrics.jsonl")
    assert [r["step"] for r in rows_part] == list(range(1, step + 1))
    for x, y in zip(rows_full, rows_part):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == y["loss"]
    return list(zip(rows_full, rows_part))


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    """A tiny random CLIP (16-dim projection) and an aesthetic head on it, saved locally (the recipes' AR
    rewards, scaled down)."""
    from tiny_reward_models import save_tiny_clip

    path = save_tiny_clip(tmp_path_factory.mktemp("recipe_clip"), projection_dim=16)
    generator = torch.Generator().manual_seed(0)
    widths = [16, 32, 8, 8, 4, 1]
    head = {}
    for index, (w_in, w_out) in zip((0, 2, 4, 6, 7), zip(widths[:-1], widths[1:])):
        head[f"layers.{index}.weight"] = torch.randn(w_out, w_in, generator=generator) / math.sqrt(w_in)
        head[f"layers.{index}.bias"] = torch.randn(w_out, generator=generator)
    torch.save(head, path / "head.pth")
    return path

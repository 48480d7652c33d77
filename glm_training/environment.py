"""Facts about the machine and the installed packages that change what a run costs or computes.

* **bf16 on the CPU.** A CPU with AVX512-BF16 or AMX (or an Arm CPU with BF16) computes a bf16 matmul in
  hardware; an AVX2-only CPU emulates it, hundreds of times slower than float32 (a 1024x4096 @ 4096x4096
  matmul: 0.4 s in float32, 126 s in bf16 on an AVX2 EPYC). `cpu_has_native_bf16` tells which, and a run that
  asks for bf16 compute on a CPU without it says so at start (`warn_if_slow_bf16`).
* **The lock.** `requirements.lock` (repository root) pins every package the tests ran with, transitive ones
  included; `setup.sh` installs from it. `lock_differences` compares it with what is installed, and
  `python -m glm_training.environment` prints the comparison and exits 1 when a locked package is missing
  or at another version, so that a drifted environment is seen rather than debugged.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

logger = logging.getLogger("glm_training")

LOCK_FILE = Path(__file__).resolve().parent.parent / "requirements.lock"
PROJECT = "glm-training"
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below which bf16 is no longer computed natively.
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10", "ALL", "DEFAULT")
_X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_ARM_BF16_FLAGS = ("bf16",)


# ---------------------------------------------------------------------------------------------------------
# bf16 on the CPU


def cpu_flags() -> set[str]:
    """The CPU's feature flags (`/proc/cpuinfo`: x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_bf16_flags() -> list[str]:
    """The CPU flags that compute bf16 in hardware (AVX512-BF16, AMX-BF16; Arm BF16), of those it has."""
    flags = cpu_flags()
    return [f for f in (*_X86_BF16_FLAGS, *_ARM_BF16_FLAGS) if f in flags]


def cpu_has_native_bf16() -> bool:
    """Whether a bf16 matmul on this CPU runs in hardware (oneDNN with AVX512-BF16 / AMX, or Arm BF16).

    Read from the CPU's flags, and from torch's own check where the flags are not readable. An
    `ONEDNN_MAX_CPU_ISA` cap below AVX512_CORE_BF16 turns the hardware path off, so it counts as none.
    """
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and not cap.startswith(_ONEDNN_BF16_ISAS):
        return False
    if cpu_flags():
        return bool(cpu_bf16_flags())
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch without the private checks
        return False


def asks_for_bf16(cfg) -> bool:
    """Whether a run config computes in bf16: bf16 autocast, or bf16 weights."""
    return cfg.trainer.mixed_precision == "bf16" or cfg.model.dtype == "bfloat16"


def warn_if_slow_bf16(cfg, device: torch.device | str) -> bool:
    """Warn (and return True) when `cfg` computes in bf16 on a CPU that has no native bf16."""
    if torch.device(device).type != "cpu" or not asks_for_bf16(cfg) or cpu_has_native_bf16():
        return False
    asked, fixes = [], []
    # With float32 master weights the compute follows model.dtype: changing the dtype changes both.
    if cfg.trainer.mixed_precision == "bf16" and not cfg.model.keeps_master_weights():
        asked.append("trainer.mixed_precision=bf16")
        fixes.append("trainer.mixed_precision=no")
    if cfg.model.dtype == "bfloat16":
        asked.append("model.dtype=bfloat16")
        fixes.append("model.dtype=float32")
    logger.warning(
        "[cpu] %s asks for bf16 compute, but this CPU (%s) has no native bf16 (no AVX512-BF16 or AMX): every "
        "bf16 matmul is emulated, up to hundreds of times slower than float32. Set %s to compute in float32.",
        " and ".join(asked),
        cpu_model(),
        " ".join(fixes),
    )
    return True


def log_environment(cfg, device: torch.device | str) -> None:
    """At a run's start: the bf16 warning where it applies; a warning when packages drifted from the lock."""
    warn_if_slow_bf16(cfg, device)
    if LOCK_FILE.is_file():
        report = lock_differences()
        if not report.matches:
            logger.warning("[env] %s", lock_summary(report))


# ---------------------------------------------------------------------------------------------------------
# The lock


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public_version(version: str) -> str:
    """`2.13.0+cpu` -> `2.13.0`: the lock pins public versions, whichever local build is installed."""
    return version.split("+", 1)[0]


def read_lock(path: Path = LOCK_FILE) -> dict[str, str]:
    """name -> version of every `name==version` line of a lock / constraints file."""
    pins: dict[str, str] = {}
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}: '{raw.strip()}' is not a 'name==version' pin")
        pins[canonical(name.strip())] = version.strip()
    return pins


def installed_versions() -> dict[str, str]:
    """name -> version of every distribution importable in this interpreter."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in found:
            found[canonical(name)] = dist.version
    return found


@dataclass
class LockReport:
    """What differs between a lock and the installed packages."""

    lock: Path
    different: list[tuple[str, str, str]] = field(default_factory=list)  # name, locked, installed
    missing: list[tuple[str, str]] = field(default_factory=list)  # name, locked
    extra: list[tuple[str, str]] = field(default_factory=list)  # name, installed (not in the lock)

    @property
    def matches(self) -> bool:
        """The locked set is installed exactly (packages beyond it are reported, not failed)."""
        return not self.different and not self.missing

    def lines(self) -> list[str]:
        out = [f"{name}: locked {want}, installed {have}" for name, want, have in self.different]
        out += [f"{name}: locked {want}, not installed" for name, want in self.missing]
        out += [f"{name}: installed {have}, not in the lock" for name, have in self.extra]
        return out


# Installed with every venv, never locked (pip freeze leaves them out too).
_NOT_LOCKED = {"pip", "setuptools", "wheel", canonical(PROJECT)}


def lock_differences(lock: Path = LOCK_FILE, installed: dict[str, str] | None = None) -> LockReport:
    """Compare the lock with the installed distributions (public versions: `2.13.0+cpu` == `2.13.0`)."""
    pins = read_lock(lock)
    have = installed_versions() if installed is None else {canonical(k): v for k, v in installed.items()}
    report = LockReport(Path(lock))
    for name, want in sorted(pins.items()):
        if name not in have:
            report.missing.append((name, want))
        elif public_version(have[name]) != public_version(want):
            report.different.append((name, want, have[name]))
    report.extra = sorted((n, v) for n, v in have.items() if n not in pins and n not in _NOT_LOCKED)
    return report


def lock_summary(report: LockReport | None = None) -> str:
    """One line for logs and test headers: whether the installed packages are the locked ones."""
    if report is None:
        if not LOCK_FILE.is_file():
            return "no requirements.lock beside the package (installed from a wheel?); versions not checked"
        report = lock_differences()
    if report.matches:
        extra = f" (+{len(report.extra)} not in the lock)" if report.extra else ""
        return f"installed packages match {LOCK_FILE.name}{extra}"
    return (
        f"installed packages DIFFER from {report.lock.name}: "
        + "; ".join(report.lines()[:8])
        + " (./setup.sh reinstalls the locked set)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m glm_training.environment",
        description="Check the installed packages against requirements.lock (exit 1 when they differ) and "
        "print the CPU's bf16 support.",
    )
    parser.add_argument("--lock", type=Path, default=LOCK_FILE, help="the lock file (default: %(default)s)")
    args = parser.parse_args(argv)
    print(f"cpu: {cpu_model()}; native bf16: {'yes' if cpu_has_native_bf16() else 'no'} {cpu_bf16_flags()}")
    if not args.lock.is_file():
        print(f"error: no lock file at {args.lock}", file=sys.stderr)
        return 2
    report = lock_differences(args.lock)
    for line in report.lines():
        print(f"  {line}")
    if report.matches:
        print(f"environment matches {args.lock.name} ({len(read_lock(args.lock))} packages)")
        return 0
    print(
        f"error: the installed packages differ from {args.lock} ({len(report.different)} at another version, "
        f"{len(report.missing)} missing). Reinstall the tested set with ./setup.sh (or rm -rf .venv && "
        "./setup.sh); to move the lock to newer releases, ./setup.sh --relock, then run the tests.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

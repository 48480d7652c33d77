"""Real processes for the robustness tests: start a run in its own session, find its ranks, signal them.

Every run starts in a new session (its own process group), and `Run.kill_all` (called in the tests' cleanup)
kills the whole group, so no worker outlives a test, whatever state it was left in (stopped, hung).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import PYTHON, REPO

TORCHRUN = [
    PYTHON,
    "-m",
    "torch.distributed.run",
    "--nproc_per_node=2",
    "--master_port=0",
    "--rdzv-backend=c10d",
    "--rdzv-endpoint=localhost:0",
]


class Run:
    """A training command running in the background, its stdout and stderr going to `log`; `env` adds to the
    test's environment."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=err, stderr=err, start_new_session=True
            )
        self.workers: set[int] = set()  # every worker pid seen (each in a session of its own, see kill_all)

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_for(self, needle: str, timeout: float = 180) -> None:
        """Until `needle` is in the log; AssertionError (with the log) if the run ends or time runs out."""
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"run ended ({self.proc.returncode}) before {needle!r}:\n{self.text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} after {timeout} s:\n{self.text()[-3000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the worker processes torchrun started (its direct children with RANK set)."""
        found = {}
        for pid in children(self.proc.pid):
            rank = env_rank(pid)
            if rank is not None:
                found[rank] = pid
        self.workers.update(found.values())
        return found

    def kill_all(self) -> None:
        """Kill the launcher's process group and every worker's.

        torchrun starts each worker in a session of its own: killing the launcher's group alone would orphan
        them, and a stopped rank would live on.
        """
        self.workers.update(children(self.proc.pid))
        for pgid in (*self.workers, self.proc.pid):
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process is resumed to die at once
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
        self.proc.wait(timeout=30)
        for pid in self.workers:
            wait_until_gone(pid, timeout=30)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def env_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until_gone(pid: int, timeout: float) -> float:
    """Seconds until `pid` exits; AssertionError after `timeout`."""
    start = time.monotonic()
    while is_running(pid):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"process {pid} still running after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def group_members(pgid: int) -> list[int]:
    """Live processes of the process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out

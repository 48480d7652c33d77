"""A run never lies and never loses a file: what it says and leaves behind is what happened.

Ctrl-C stops gracefully, a refused run leaves its folder as it was, a run that made no update or whose
weights broke does not say done, metrics.jsonl survives a torn line and never mixes two runs, an output
folder that cannot be written is one line before anything loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading

import pytest
from conftest import DIT_SMALL, REPO

from glm_training import preemption
from glm_training.cli import run
from glm_training.metrics import MetricsWriter, read_metrics

SMALL = [*DIT_SMALL, "logging.tensorboard=false"]
ALWAYS_FAILS = f"{REPO}/tests/user_rewards/faults.py:AlwaysFails"


def folder_state(root) -> dict[str, str]:
    """Every file under `root` by relative path, with the SHA-256 of its bytes (folders as "dir")."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def test_ctrl_c_asks_for_the_graceful_stop_that_sigterm_does(monkeypatch):
    """SIGINT is recorded like SIGTERM (finish the step, checkpoint, exit 0: the loop's path, tested with
    SIGTERM in test_robustness_signals.py), not a KeyboardInterrupt; the same signal again at once (torchrun's
    agent forwarding the terminal's Ctrl-C) changes nothing; the previous handler comes back afterwards."""
    assert threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    signals = preemption.StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # handled before the next line runs, in the main thread
        assert signals.requested and signals.received == signal.SIGINT
        clock = signals.received_at + 0.5 * preemption.REPEAT_S
        monkeypatch.setattr(preemption.time, "monotonic", lambda: clock)
        signals._handle(signal.SIGINT, None)  # the forwarded copy: no exit
        assert signals.received == signal.SIGINT
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_refused_resume_leaves_the_run_folder_byte_for_byte(tmp_path, capsys):
    """A joint run told to resume a DiT run's folder is refused once it has loaded; the DiT run's files,
    config.yaml included, are exactly as they were."""
    out = tmp_path / "dit-run"
    assert run("dit", "t2i_training", [*SMALL, "trainer.num_steps=1", f"trainer.output_dir={out}"]) == 0
    before = folder_state(out)
    joint = ["trainer.progress_bar=false", "logging.tensorboard=false", "eval.every_n_steps=0"]
    code = run("joint", "joint_training", [*joint, f"trainer.output_dir={out}", "trainer.resume=latest"])
    assert code == 2, capsys.readouterr().err[-2000:]
    assert folder_state(out) == before


def test_a_run_whose_every_step_was_skipped_does_not_say_done(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        *SMALL,
        "trainer.num_steps=2",
        f"trainer.output_dir={out}",
        f"reward.names=[{ALWAYS_FAILS}]",
        "reward.max_retries=0",
        "reward.on_failure=skip",
    ]
    assert run("dit", "t2i_training", args) == 2
    captured = capsys.readouterr()
    assert "done" not in captured.out
    assert "no update in steps 1-2: skipped for reward failure" in captured.err.strip().splitlines()[-1]
    assert [r["skipped_reward_failure"] for r in read_metrics(out / "metrics.jsonl")] == [1, 1]
    assert not (out / "checkpoints").exists()


def test_weights_made_non_finite_by_an_update_stop_the_run_before_anything_holds_them(tmp_path, capsys):
    """optim.lr=inf: the first update's gradient is finite, the weights it leaves are not. The run stops
    at step 1 with the cause, before a metrics row, an evaluation or a checkpoint of that step."""
    out = tmp_path / "run"
    args = [
        *SMALL,
        "trainer.num_steps=2",
        "trainer.save_every=1",
        "optim.lr=inf",
        f"trainer.output_dir={out}",
    ]
    assert run("dit", "t2i_training", args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step 1: an update with a finite gradient norm left trained weights NaN or inf" in err
    assert "optim.lr=inf" in err
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    """A write cut short leaves half a row at the end of metrics.jsonl; the resume drops it (and the rows
    after its step) with a warning instead of failing."""
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write({"step": step, "reward_mean": 0.5})
    with (tmp_path / "metrics.jsonl").open("a", encoding="utf-8") as f:
        f.write('{"step": 4, "reward_me')
    with caplog.at_level("WARNING", logger="glm_training"):
        writer.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert any("line 4 is not a whole JSON row; dropped" in r.getMessage() for r in caplog.records)


def test_a_new_run_never_appends_to_another_runs_metrics(tmp_path, capsys):
    """A folder left with metrics but no checkpoint (a run stopped before its first save) is refused for a
    fresh run before anything loads; the old metrics stay as they were."""
    out = tmp_path / "run"
    out.mkdir()
    old = json.dumps({"step": 1, "reward_mean": 0.25}) + "\n"
    (out / "metrics.jsonl").write_text(old, encoding="utf-8")
    assert run("dit", "t2i_training", [*SMALL, f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds the metrics.jsonl of another run" in err and "new trainer.output_dir" in err
    assert (out / "metrics.jsonl").read_text(encoding="utf-8") == old
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    target = tmp_path / "a-file" / "run"
    if where == "under-a-file":
        (tmp_path / "a-file").write_text("not a folder", encoding="utf-8")
    else:
        target = "/proc/glm-training-test/run"  # no one can make a folder there, root included
    assert run("dit", "t2i_training", [*SMALL, f"trainer.output_dir={target}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"error: trainer.output_dir: '{target}' cannot be made or written")
    assert not any("Traceback" in line for line in lines)

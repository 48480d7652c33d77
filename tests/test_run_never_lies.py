"""A run never lies and never loses a file: what it says and leaves behind is what happened.

Ctrl-C stops gracefully, a refused run leaves its folder as it was, a run that made no update or whose
weights broke does not say done, metrics.jsonl survives a torn line and never mixes two runs, an output
folder that cannot be written is one line before anything loads, every reader of a checkpoint checks its
hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading

import pytest
from conftest import DIT_SMALL, REPO

from glm_training import preemption
from glm_training.cli import run
from glm_training.evaluate import main as evaluate_main
from glm_training.export import main as export_main
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
    previous = signal.getsignal(signal.SIGINT)  # Python's KeyboardInterrupt, or ignored in a background job
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
    assert signal.getsignal(signal.SIGINT) == previous


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


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A DiT run with checkpoints at steps 1 and 2 (copied by each test that damages it)."""
    out = tmp_path_factory.mktemp("never-lies") / "run"
    args = [*SMALL, "trainer.num_steps=2", "trainer.save_every=1", f"trainer.output_dir={out}"]
    assert run("dit", "t2i_training", args) == 0
    return out


def damaged_copy(run_dir, tmp_path, file: str, data: bytes | None = None):
    """A copy of `run_dir` whose step-2 `file` is overwritten in place: 4 KiB of zeros at its middle (same
    size), or `data`."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    target = copy / "checkpoints" / "step-000002" / file
    if data is not None:
        target.write_bytes(data)
        return copy, target
    with target.open("r+b") as f:
        f.seek(target.stat().st_size // 2)
        f.write(bytes(4096))
    return copy, target


def test_evaluate_and_export_read_only_verified_checkpoints(two_checkpoints, tmp_path, capsys, caplog):
    """A weights file damaged at the same size: the damaged checkpoint given by name is one line naming the
    file; given the run folder, export takes the newest intact checkpoint, naming the damaged one."""
    copy, target = damaged_copy(two_checkpoints, tmp_path, "trainable.safetensors")
    step_two = target.parent
    assert evaluate_main(["--checkpoint", str(step_two), "--output", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"'{target}' does not match its recorded SHA-256" in err[-1] and len(err) == 1
    assert not (tmp_path / "eval").exists()
    assert export_main(["--checkpoint", str(step_two), "--output", str(tmp_path / "refused")]) == 2
    assert f"'{target}' does not match" in capsys.readouterr().err
    with caplog.at_level("WARNING", logger="glm_training"):
        assert export_main(["--checkpoint", str(copy), "--output", str(tmp_path / "exported")]) == 0
    (used,) = json.loads((tmp_path / "exported" / "export_info.json").read_text())["checkpoints"]
    assert used["step"] == 1
    assert any(f"skipping checkpoint {step_two}" in r.getMessage() for r in caplog.records)


def test_a_damaged_state_file_is_named_and_resume_falls_back(two_checkpoints, tmp_path, caplog):
    """`trainer_state.json` is written after the hashes; a damaged one is found by the same check: the resume
    takes step 1, sets step 2 aside and trains it again."""
    copy, target = damaged_copy(two_checkpoints, tmp_path, "trainer_state.json", b'{"step": 2, "comp')
    args = [*SMALL, "trainer.num_steps=2", "trainer.save_every=1", f"trainer.output_dir={copy}"]
    with caplog.at_level("WARNING", logger="glm_training"):
        assert run("dit", "t2i_training", [*args, "trainer.resume=latest"]) == 0
    assert any(f"'{target}' is damaged" in r.getMessage() for r in caplog.records)
    names = sorted(p.name for p in (copy / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002", "step-000002.damaged"]
    assert [r["step"] for r in read_metrics(copy / "metrics.jsonl")] == [1, 2]

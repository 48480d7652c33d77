"""Fuzzed inputs and untrusted checkpoints.

Property tests (hypothesis) feed random config overrides and prompt files to what the entry points run
before any model loads (`load_config`, `load_prompts`, the reward checks), through `report_user_errors`:
every case either loads or exits 2 with one `error: ...` line, never a traceback. Checkpoints: every
`torch.load` in the package uses `weights_only=True` (an AST audit), and a checkpoint whose files fail their
recorded hashes is refused, naming the file, while `resume=latest` falls back to the newest intact one.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import string
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from conftest import DIT_SMALL, REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm_training.checkpoint import CheckpointError, resolve_resume, verify_checkpoint
from glm_training.cli import run
from glm_training.config import DiTTrainConfig, load_config
from glm_training.data import load_prompts
from glm_training.engine.trainer import DiTTrainer
from glm_training.errors import report_user_errors
from glm_training.rewards import RewardSet

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def exits_cleanly(body) -> tuple[int, str]:
    """`report_user_errors(body)` -> (status, stderr); any other exception fails the test (traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = report_user_errors(body)
    text = err.getvalue()
    if status == 2:
        assert text.startswith("error: ") and "Traceback" not in text, text
    else:
        assert status == 0
    return status, text


# --------------------------------------------------------------------------- config overrides


def schema_keys(node=DiTTrainConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in fields(node):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys += schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


KEYS = schema_keys()
SCALARS = st.one_of(
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(alphabet=string.printable, max_size=12),
    st.text(max_size=6),  # any unicode
)


def render(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return str(value)


OVERRIDE = st.one_of(
    st.builds(
        lambda k, v: f"{k}={render(v)}",
        st.sampled_from(KEYS),
        st.one_of(SCALARS, st.lists(SCALARS, max_size=3)),
    ),
    st.builds(
        lambda k, v: f"{k}={render(v)}",
        st.text(alphabet=string.ascii_letters + "._+~", min_size=1, max_size=15),
        SCALARS,
    ),
    st.text(alphabet=string.printable, max_size=25),  # anything at all
)


@FUZZ
@given(overrides=st.lists(OVERRIDE, max_size=4))
def test_any_config_overrides_load_or_exit_2_with_one_line(overrides):
    def body() -> str:
        cfg = load_config(["model=tiny", *overrides], "t2i_training")
        # What the trainer checks next, still before any model loads (reward names and options, batch split).
        if all(":" not in name for name in cfg.reward.names):
            RewardSet(cfg.reward.weight_map(), cfg.reward.options, cfg.reward.combine).close()
        cfg.data.per_rank_samples(1)
        return "ok"

    exits_cleanly(body)


# --------------------------------------------------------------------------- prompt files

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
LINES = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda n, c: c * n, st.integers(0, 200_000), st.sampled_from(["a", "é", " ", "#", "\x00", "😀"])
    ),
    st.builds(json.dumps, st.dictionaries(st.sampled_from(["prompt", "text", "x"]), JSON_VALUES, max_size=3)),
    st.builds(json.dumps, JSON_VALUES),
    st.builds(lambda s: '{"prompt": ' + s, st.text(max_size=10)),  # cut short
)


@FUZZ
@given(
    lines=st.lists(LINES, max_size=6),
    suffix=st.sampled_from([".txt", ".jsonl"]),
    encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "latin-1"]),
    junk=st.binary(max_size=20),
)
def test_any_prompt_file_loads_or_exits_2_with_one_line(tmp_path, lines, suffix, encoding, junk):
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes("\n".join(lines).encode(encoding, errors="replace") + junk)
    status, text = exits_cleanly(lambda: str(len(load_prompts(path))))
    if status == 2:
        assert str(path) in text  # names the file (and the line where there is one)


# --------------------------------------------------------------------------- checkpoints


def test_every_torch_load_in_the_package_uses_weights_only_true():
    calls = []
    for path in sorted((REPO / "glm_training").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and func.attr == "load":
                if isinstance(func.value, ast.Name) and func.value.id == "torch":
                    weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                    ok = weights_only and isinstance(weights_only[0].value, ast.Constant)
                    calls.append(
                        (f"{path.relative_to(REPO)}:{node.lineno}", ok and weights_only[0].value.value)
                    )
    assert len(calls) >= 5  # the audit sees the checkpoint, export and reward-model loads
    assert [where for where, ok in calls if ok is not True] == []


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("lastest", "is neither 'latest' nor a folder that exists; did you mean 'latest'?"),
        ("run", "is a run's folder; name one of its checkpoints"),
        ("run/checkpoints", "is not a checkpoint folder (no trainer_state.json)"),
    ],
)
def test_a_wrong_resume_target_is_refused_before_anything_is_loaded_or_written(
    tmp_path, capsys, target, needle
):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    resume = target if target == "lastest" else str(tmp_path / target)
    out = tmp_path / "out"
    args = [*DIT_SMALL, f"trainer.output_dir={out}", f"trainer.resume={resume}"]
    assert run(DiTTrainer, "t2i_training", args) == 2
    err = capsys.readouterr().err
    assert needle in err and "[load]" not in err
    assert not out.exists()  # no config.yaml left behind


def test_a_hub_model_that_is_not_cached_is_one_message_naming_the_download(tmp_path, capsys):
    """Offline (the tests' HF_HUB_OFFLINE=1), a hub id with no cached copy: exit 2 with the command that gets
    it, not diffusers' traceback, before anything loads or is written."""
    args = [*DIT_SMALL, "model.name=nobody/none-such", f"trainer.output_dir={tmp_path / 'out'}"]
    assert run(DiTTrainer, "t2i_training", args) == 2
    err = capsys.readouterr().err
    assert "error: cannot load model 'nobody/none-such'" in err and "`hf download nobody/none-such`" in err
    assert "[load]" not in err and not (tmp_path / "out").exists()  # no config.yaml left behind


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    args = [*DIT_SMALL, "trainer.num_steps=2", "trainer.save_every=1", f"trainer.output_dir={out}"]
    assert run(DiTTrainer, "t2i_training", args) == 0
    return out


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_latest_falls_back(
    two_checkpoints, tmp_path, damage
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    newest = out / "checkpoints" / "step-000002"
    assert verify_checkpoint(newest) is None and json.loads((newest / "hashes.json").read_text())
    target = newest / ("optimizer.pt" if damage != "flip a byte" else "trainable.safetensors")
    data = bytearray(target.read_bytes())
    if damage == "flip a byte":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) // 2]))
    else:
        target.unlink()

    with pytest.raises(
        CheckpointError, match=rf"'{target}' (does not match its recorded SHA-256|is missing)"
    ):
        resolve_resume(str(newest), out)
    assert resolve_resume("latest", out) == out / "checkpoints" / "step-000001"

    # The entry point: an explicit damaged checkpoint exits 2 naming the file; latest resumes from step 1.
    base = [*DIT_SMALL, "trainer.num_steps=3", "trainer.save_every=1", f"trainer.output_dir={out}"]
    assert run(DiTTrainer, "t2i_training", [*base, f"trainer.resume={newest}"]) == 2
    if damage == "flip a byte":
        # It trains past the damaged step to the end, writing that step's checkpoint again; the damaged
        # folder is set aside, not deleted.
        assert run(DiTTrainer, "t2i_training", [*base, "trainer.resume=latest"]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]  # step 2 was redone from the step-1 checkpoint
        checkpoints = out / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            "step-000001",
            "step-000002",
            "step-000002.damaged",
            "step-000003",
        ]
        assert verify_checkpoint(newest) is None and verify_checkpoint(checkpoints / "step-000003") is None
        assert (checkpoints / "step-000002.damaged" / target.name).read_bytes() == bytes(data)
        # An older checkpoint resumed into the run that holds later ones is refused before any step: the
        # run would write them again.
        older = [*base, f"trainer.resume={checkpoints / 'step-000001'}"]
        assert run(DiTTrainer, "t2i_training", older) == 2
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 3

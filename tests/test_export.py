"""`python -m glm_training.export`: real tiny checkpoints -> a pipeline folder that plain diffusers loads.

The trainers run in-process for one or two steps on the tiny model (once per module); the exported folders
are then loaded by a fresh Python process that never imports `glm_training`, with nothing but
`GlmImagePipeline.from_pretrained` (plus the documented adapter snippet for `--lora-format separate`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import conftest
import numpy as np
import pytest
import torch
from conftest import PYTHON, run_cli
from safetensors.torch import load_file

from glm_training.checkpoint import CheckpointError, resolve_checkpoint
from glm_training.checkpoint.integrity import write_hashes
from glm_training.cli import run
from glm_training.engine.trainer import ARTrainer, DiTTrainer
from glm_training.export import load_pipeline_from_checkpoints, main

DIT_SMALL = [
    "trainer.progress_bar=false",
    "sampling.height=32",
    "sampling.width=32",
    "sampling.num_steps=2",
    "data.num_groups_per_step=2",
    "data.num_generations=2",
    "trainer.num_steps=1",
    "eval.every_n_steps=0",
]
AR_SMALL = [
    *conftest.AR_SMALL,
    "algo.micro_batch_size=4",
    "algo.dynamic_sampling=false",
    "trainer.num_steps=1",
]
# One optimizer step of Adam moves every weight by about lr, so a large lr makes one step visible.
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "optim.lr=0.1"]
FULL = ["model.lora.enabled=false", "optim.lr=0.05"]
# The references' EMA updated once per optimizer step (`engine/ema.py`): decay min(0.9, (1 + s) / (10 + s)).
EMA_DECAY_STEP_1, EMA_DECAY_STEP_2 = 2 / 11, 3 / 12


def _train(tmp_path_factory, name: str, trainer_cls, config: str, args: list[str]) -> Path:
    out = tmp_path_factory.mktemp(name)
    assert run(trainer_cls, config, [*args, f"trainer.output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def dit_lora_run(tmp_path_factory, tiny_model_dir) -> Path:
    # Two steps, a checkpoint after each: the EMA after step 2 mixes both steps' weights.
    extra = ["trainer.num_steps=2", "trainer.save_every=1", "algo.ema=true", "algo.ema_decay=0.9"]
    extra += ["algo.ema_update_interval=1", "algo.ema_calls=per_optimizer_step"]
    return _train(tmp_path_factory, "dit_lora", DiTTrainer, "t2i_training", [*DIT_SMALL, *LORA, *extra])


@pytest.fixture(scope="module")
def dit_full_run(tmp_path_factory, tiny_model_dir) -> Path:
    return _train(tmp_path_factory, "dit_full", DiTTrainer, "t2i_training", [*DIT_SMALL, *FULL])


@pytest.fixture(scope="module")
def ar_lora_run(tmp_path_factory, tiny_model_dir) -> Path:
    return _train(tmp_path_factory, "ar_lora", ARTrainer, "ar_training", [*AR_SMALL, *LORA])


@pytest.fixture(scope="module")
def ar_full_run(tmp_path_factory, tiny_model_dir) -> Path:
    return _train(tmp_path_factory, "ar_full", ARTrainer, "ar_training", [*AR_SMALL, *FULL])


def _step(run_dir: Path, step: int = 1) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


@pytest.fixture(scope="module")
def exports(tmp_path_factory, dit_lora_run, dit_full_run, ar_lora_run, ar_full_run) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    jobs = {
        # Run folders resolve to their newest checkpoint (step 2 of the DiT LoRA run).
        "lora_merged": ["--checkpoint", str(dit_lora_run), "--checkpoint", str(ar_lora_run)],
        "lora_separate": [
            "--checkpoint",
            str(_step(dit_lora_run, 2)),
            "--checkpoint",
            str(_step(ar_lora_run)),
            "--lora-format",
            "separate",
        ],
        "full": ["--checkpoint", str(_step(ar_full_run)), "--checkpoint", str(_step(dit_full_run))],
    }
    for name, args in jobs.items():
        assert main([*args, "--output", str(root / name)]) == 0
    return {name: root / name for name in jobs}


# Runs in a fresh interpreter: plain diffusers, the loading snippet of the export module's docstring.
LOADER = r"""
import json, sys
import numpy as np, torch
from diffusers import GlmImagePipeline
from safetensors.torch import save_file

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
out = spec["out"]


def generate(pipe):
    torch.manual_seed(0)
    result = pipe(prompt=["a sign that says 'OPEN'"], height=32, width=32, num_inference_steps=2,
                  guidance_scale=1.5, generator=torch.Generator().manual_seed(0), output_type="np")
    return result.images[0]


def dump(pipe, name):
    for part in ("transformer", "vision_language_encoder"):
        state = {k: v.contiguous() for k, v in getattr(pipe, part).state_dict().items()}
        save_file(state, f"{out}/{name}-{part}.safetensors")


images = {}
base = GlmImagePipeline.from_pretrained(spec["base"])
images["base"] = generate(base)
images["base_again"] = generate(base)
dump(base, "base")

images["lora_merged"] = generate(GlmImagePipeline.from_pretrained(spec["lora_merged"]))

sep = spec["lora_separate"]
pipe = GlmImagePipeline.from_pretrained(sep)
images["separate_without_adapters"] = generate(pipe)
pipe.transformer.load_lora_adapter(
    f"{sep}/lora/transformer", weight_name="pytorch_lora_weights.safetensors", prefix=None
)
images["separate_dit_adapter"] = generate(pipe)
pipe.vision_language_encoder.load_adapter(f"{sep}/lora/vision_language_encoder")
images["separate_both_adapters"] = generate(pipe)

full = GlmImagePipeline.from_pretrained(spec["full"])
images["full"] = generate(full)
dump(full, "full")

np.savez(f"{out}/images.npz", **images)
with open(f"{out}/report.json", "w") as f:
    json.dump({"glm_training_imported": any(m.split(".")[0] == "glm_training" for m in sys.modules)}, f)
"""


@pytest.fixture(scope="module")
def fresh_load(tmp_path_factory, exports, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("fresh_load")
    spec = {"out": str(out), "base": str(tiny_model_dir), **{k: str(v) for k, v in exports.items()}}
    result = run_cli([PYTHON, "-c", LOADER, json.dumps(spec)], timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _images(fresh_load: Path) -> dict[str, np.ndarray]:
    return dict(np.load(fresh_load / "images.npz"))


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def test_exported_folders_load_without_project_code(fresh_load):
    report = json.loads((fresh_load / "report.json").read_text())
    assert report["glm_training_imported"] is False


def test_lora_exports_change_the_images_and_separate_adapters_reproduce_the_merged_ones(fresh_load):
    images = _images(fresh_load)
    # Same seed, same weights -> the same image, so any difference below comes from the weights.
    assert _max_diff(images["base"], images["base_again"]) == 0.0
    # Separate format: the pipeline's own weights are the base model's, untouched.
    assert _max_diff(images["separate_without_adapters"], images["base"]) == 0.0
    # The DiT adapters alone (same AR tokens as the base) already change the image ...
    assert _max_diff(images["separate_dit_adapter"], images["base"]) > 1e-3
    # ... and the AR adapters change it further.
    assert _max_diff(images["separate_both_adapters"], images["separate_dit_adapter"]) > 1e-3
    assert _max_diff(images["lora_merged"], images["base"]) > 1e-3
    # Merging is W + (alpha / r) B A in float32: equal to the unmerged forward up to rounding.
    assert _max_diff(images["separate_both_adapters"], images["lora_merged"]) < 1e-4


def test_combined_full_fine_tuning_export_holds_both_trained_components(
    fresh_load, dit_full_run, ar_full_run
):
    images = _images(fresh_load)
    assert _max_diff(images["full"], images["base"]) > 1e-3
    for part, run_dir in (("transformer", dit_full_run), ("vision_language_encoder", ar_full_run)):
        trained = load_file(str(_step(run_dir) / "trainable.safetensors"))
        loaded = load_file(str(fresh_load / f"full-{part}.safetensors"))
        base = load_file(str(fresh_load / f"base-{part}.safetensors"))
        assert trained and set(trained) <= set(loaded), part
        for name, value in trained.items():
            assert torch.equal(loaded[name], value), (part, name)
        assert sum(not torch.equal(base[n], v) for n, v in trained.items()) > len(trained) // 2, part
        # What did not train (for the AR model: the vision tower and VQ tokenizer) is the base's.
        for name in set(loaded) - set(trained):
            assert torch.equal(loaded[name], base[name]), (part, name)


def test_export_info_and_adapter_files(exports, dit_lora_run, ar_lora_run):
    info = json.loads((exports["lora_separate"] / "export_info.json").read_text())
    assert info["lora_format"] == "separate" and info["ema"] is False and info["base_model"] == "tiny"
    assert [(c["component"], c["step"], c["lora"]) for c in info["checkpoints"]] == [
        ("dit", 2, True),
        ("ar", 1, True),
    ]
    assert info["checkpoints"][0]["path"] == str(_step(dit_lora_run, 2).resolve())
    lora = exports["lora_separate"] / "lora"
    assert (lora / "transformer" / "pytorch_lora_weights.safetensors").is_file()
    assert (lora / "vision_language_encoder" / "adapter_model.safetensors").is_file()
    assert (lora / "vision_language_encoder" / "adapter_config.json").is_file()
    # The merged export is an ordinary pipeline: no adapter weights anywhere in it.
    merged = exports["lora_merged"]
    assert not (merged / "lora").exists()
    for part in ("transformer/diffusion_pytorch_model", "vision_language_encoder/model"):
        keys = load_file(str(merged / f"{part}.safetensors")).keys()
        assert keys and not any("lora" in k for k in keys), part
    # No temporary sibling folder is left behind.
    assert sorted(p.name for p in merged.parent.iterdir()) == ["full", "lora_merged", "lora_separate"]


def test_ema_export_loads_the_moving_average(dit_lora_run):
    pipe = load_pipeline_from_checkpoints([dit_lora_run], use_ema=True, merge_lora=False)
    params = dict(pipe.transformer.named_parameters())
    step1 = load_file(str(_step(dit_lora_run, 1) / "trainable.safetensors"))
    step2 = load_file(str(_step(dit_lora_run, 2) / "trainable.safetensors"))
    assert step1.keys() == step2.keys() and len(step2) > 0
    for name, w2 in step2.items():
        if "lora_B" not in name:
            continue  # the EMA starts at the initial weights, which no checkpoint holds; lora_B's are 0
        # EMA after two steps = d2 (d1 w0 + (1 - d1) w1) + (1 - d2) w2 with w0 = 0, matched here by name.
        expected = EMA_DECAY_STEP_2 * (1 - EMA_DECAY_STEP_1) * step1[name] + (1 - EMA_DECAY_STEP_2) * w2
        torch.testing.assert_close(params[name].detach(), expected, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(step1[n], step2[n]) for n in step2)


def test_resolve_checkpoint_picks_the_newest_complete_step(tmp_path, dit_full_run):
    source = _step(dit_full_run)
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("step-000002", "step-000010"):
        shutil.copytree(source, checkpoints / name)
    # Incomplete: a save that died before its rename, and one without trainer_state.json.
    shutil.copytree(source, checkpoints / "step-000011.tmp")
    shutil.copytree(source, checkpoints / "step-000012")
    (checkpoints / "step-000012" / "trainer_state.json").unlink()
    assert resolve_checkpoint(tmp_path / "run") == checkpoints / "step-000010"
    assert resolve_checkpoint(checkpoints) == checkpoints / "step-000010"
    assert resolve_checkpoint(checkpoints / "step-000002") == checkpoints / "step-000002"
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        resolve_checkpoint(checkpoints / "step-000012")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_overwrite_replaces_a_previous_export_only_when_asked(tmp_path, dit_full_run, ar_full_run, capsys):
    out = tmp_path / "export"
    assert main(["--checkpoint", str(ar_full_run), "--output", str(out)]) == 0
    before = (out / "export_info.json").read_text()
    assert main(["--checkpoint", str(dit_full_run), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "export_info.json").read_text() == before
    args = ["--checkpoint", str(dit_full_run), "--output", str(out), "--overwrite", "--dtype", "bfloat16"]
    assert main(args) == 0
    info = json.loads((out / "export_info.json").read_text())
    assert [c["component"] for c in info["checkpoints"]] == ["dit"] and info["dtype"] == "bfloat16"
    for part in ("transformer/diffusion_pytorch_model", "vision_language_encoder/model"):
        weights = load_file(str(out / f"{part}.safetensors"))
        assert {v.dtype for v in weights.values()} == {torch.bfloat16}, part
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging or old folder left


# ---------------------------------------------------------------------------------------------------------
# Bad input: exit status 2 and a message, before any model is loaded. The checkpoints below are copies whose
# base model points at a folder that does not exist (their hashes recorded anew, as a run of that model would
# have them), so reaching the loading stage would fail differently.


def _unloadable(step_dir: Path, dest: Path, model_name: str = "absent-model") -> Path:
    shutil.copytree(step_dir, dest)
    config = dest / "config.yaml"
    text = config.read_text()
    assert "  name: tiny\n" in text
    config.write_text(text.replace("  name: tiny\n", f"  name: {dest.parent / model_name}\n"))
    write_hashes(dest)  # as a trainer writes it: hashes.json records the config it holds
    return dest


def _bad(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_not_a_checkpoint_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _bad(["--checkpoint", str(tmp_path / "empty"), "--output", str(tmp_path / "out")], capsys)
    assert "not a checkpoint folder" in err or "neither a checkpoint folder" in err
    assert "checkpoints/step-NNNNNN/" in err and "trainer_state.json" in err
    assert not (tmp_path / "out").exists()


def test_existing_output_is_refused(tmp_path, dit_lora_run, capsys):
    ckpt = _unloadable(_step(dit_lora_run, 2), tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err = _bad(["--checkpoint", str(ckpt), "--output", str(tmp_path / "out")], capsys)
    assert "already exists" in err and "--overwrite" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_overwrite_only_replaces_an_earlier_export(tmp_path, dit_lora_run, capsys):
    ckpt = _unloadable(_step(dit_lora_run, 2), tmp_path / "ckpt")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.txt").write_text("mine")
    err = _bad(["--checkpoint", str(ckpt), "--output", str(tmp_path / "home"), "--overwrite"], capsys)
    assert "not a pipeline folder" in err
    assert (tmp_path / "home" / "thesis.txt").read_text() == "mine"
    err = _bad(["--checkpoint", str(ckpt), "--output", str(tmp_path / "no" / "such" / "out")], capsys)
    assert "does not exist or is not writable" in err


def test_two_checkpoints_of_the_same_component_are_refused(tmp_path, dit_lora_run, dit_full_run, capsys):
    a = _unloadable(_step(dit_lora_run, 2), tmp_path / "a")
    b = _unloadable(_step(dit_full_run), tmp_path / "b")
    err = _bad(["--checkpoint", str(a), "--checkpoint", str(b), "--output", str(tmp_path / "out")], capsys)
    assert "both checkpoints train the dit" in err


def test_checkpoints_of_different_base_models_are_refused(tmp_path, dit_full_run, ar_full_run, capsys):
    a = _unloadable(_step(dit_full_run), tmp_path / "a", model_name="model-a")
    b = _unloadable(_step(ar_full_run), tmp_path / "b", model_name="model-b")
    err = _bad(["--checkpoint", str(a), "--checkpoint", str(b), "--output", str(tmp_path / "out")], capsys)
    assert "different base models" in err


def test_ema_export_of_a_run_without_ema_is_refused(tmp_path, dit_full_run, capsys):
    ckpt = _unloadable(_step(dit_full_run), tmp_path / "ckpt")
    err = _bad(["--checkpoint", str(ckpt), "--ema", "--output", str(tmp_path / "out")], capsys)
    assert "ema.pt" in err and "drop --ema" in err


def test_overwrite_never_deletes_the_checkpoint_being_exported(tmp_path, dit_full_run, capsys):
    ckpt = _unloadable(_step(dit_full_run), tmp_path / "run" / "checkpoints" / "step-000001")
    (tmp_path / "run" / "model_index.json").write_text("{}")  # looks like an earlier export
    err = _bad(["--checkpoint", str(ckpt), "--output", str(tmp_path / "run"), "--overwrite"], capsys)
    assert "contains the checkpoint" in err
    assert (ckpt / "trainable.safetensors").is_file()

"""`trainer.strategy=fsdp` (FSDP2) against DDP, for real: 2 ranks under torchrun (gloo, CPU), both trainers.

One launch per trainer runs, in one process group: full fine-tuning and LoRA (each with a KL term, so the
reference pass runs through the sharded modules), each under ddp and fsdp for 2 steps with a checkpoint
after each, and an fsdp run resumed from the first checkpoint. Evaluation runs at steps 0 and 2 on 3
prompts in batches of 2, so the ranks hold 2 prompts and 1: the sharded run must pad (the AR model makes
one generate() call per prompt, each a collective; unpadded, it hangs).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import AR_SMALL, DIT_SMALL, REPO, torchrun
from safetensors.torch import load_file

from glm_training.export import main as export_main
from glm_training.metrics import read_metrics

AR = [*AR_SMALL, "algo.micro_batch_size=1", "algo.dynamic_sampling=false"]
# 3 samples a rank in micro-batches of 1: gradients accumulate over 3 backward passes per optimizer step.
# Flow-GRPO's noise level (the recipes'; the tiny default samples at 1.0): the LoRA bound below was set there.
# At 1.0 the LoRA runs' weights after step 2 differ by up to 2.4e-3 (of a 9e-3 move): rounding in the
# gradient sums, amplified as the comment on MODES describes.
DIT = [*DIT_SMALL, "sampling.micro_batch_size=1", "algo.num_mini_batches=1", "sampling.noise_level=0.7"]
COMMON = [
    "trainer.num_steps=2",
    "trainer.save_every=1",
    "algo.beta=0.04",
    "eval.every_n_steps=2",
    "eval.num_prompts=3",
    "eval.batch_size=2",
]
MODES = {
    "full": ["model.lora.enabled=false", "optim.lr=1e-3"],
    # LoRA's A matrices get their first non-zero gradient at step 2 (B starts at 0), and Adam's first step
    # moves each element by about lr * sign(g): where g is at the level of rounding, the sum order alone
    # would flip it. An eps above that level keeps the update proportional to g there.
    "lora": [
        "model.lora.enabled=true",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "optim.lr=1e-2",
        "optim.eps=1e-4",
    ],
}
# fp32 on both sides; the sharded and replicated runs differ only in how gradients are summed over ranks
# (reduce-scatter vs all-reduce), whose rounding is then carried through a second rollout and Adam step.
WEIGHT_ATOL = 1e-5


def _launch(tmp_path_factory, kind: str) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp(f"fsdp_{kind}")
    base = [*(DIT if kind == "dit" else AR), *COMMON]
    runs = {}
    for mode, mode_args in MODES.items():
        for strategy in ("ddp", "fsdp"):
            runs[f"{mode}/{strategy}"] = [
                *base,
                *mode_args,
                f"trainer.strategy={strategy}",
                f"trainer.output_dir={out / mode / strategy}",
            ]
        runs[f"{mode}/resumed"] = [
            *base,
            *mode_args,
            "trainer.strategy=fsdp",
            f"trainer.output_dir={out / mode / 'resumed'}",
            f"trainer.resume={_checkpoint(out / mode / 'fsdp', 1)}",
        ]
    # "-whole-load" and "-per-unit" load the previous way: every rank loads the whole pipeline, then shards
    # (by default the trained component is built empty and each rank reads its shards from the files).
    if kind == "ar":
        # generate() through per-unit gathers: every generated token is a collective of every unit.
        runs["lora/fsdp-per-unit"] = [
            *runs["lora/fsdp"][:-1],
            f"trainer.output_dir={out / 'lora' / 'fsdp-per-unit'}",
            "trainer.fsdp_gather_for_rollout=false",
            "trainer.fsdp_load_into_shards=false",
        ]
    if kind == "dit":
        # The frozen reference's shards in host memory (on a CPU machine the same numbers as on the device),
        # and sampling through per-unit gathers instead of the whole component gathered once: neither may
        # change a number.
        runs["full/fsdp-offload"] = [
            *runs["full/fsdp"][:-1],
            f"trainer.output_dir={out / 'full' / 'fsdp-offload'}",
            "trainer.fsdp_reference_offload=true",
            "trainer.fsdp_gather_for_rollout=false",
        ]
        runs["full/fsdp-whole-load"] = [
            *runs["full/fsdp"][:-1],
            f"trainer.output_dir={out / 'full' / 'fsdp-whole-load'}",
            "trainer.fsdp_load_into_shards=false",
        ]
        runs["lora/fsdp-bf16"] = [
            *runs["lora/fsdp"][:-1],
            f"trainer.output_dir={out / 'lora' / 'fsdp-bf16'}",
            "trainer.mixed_precision=bf16",
            "model.gradient_checkpointing=true",  # recomputation re-gathers the unit's weights
        ]
        # Refused before any collective: every rank reads the checkpoint's strategy.
        runs["full/ddp-from-fsdp!error"] = [
            *base,
            *MODES["full"],
            f"trainer.output_dir={out / 'full' / 'ddp-from-fsdp'}",
            f"trainer.resume={_checkpoint(out / 'full' / 'fsdp', 1)}",
        ]
    script = str(REPO / "tests" / "scripts" / "fsdp_check.py")
    result = torchrun(script, [str(out), kind, json.dumps(runs)], timeout=420)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, {name: [rep[name] for rep in reports] for name in runs}, result.stderr


@pytest.fixture(scope="module")
def dit_runs(tmp_path_factory, tiny_model_dir):
    return _launch(tmp_path_factory, "dit")


@pytest.fixture(scope="module")
def ar_runs(tmp_path_factory, tiny_model_dir):
    return _launch(tmp_path_factory, "ar")


@pytest.fixture(params=["dit", "ar"])
def runs(request):
    return request.getfixturevalue(f"{request.param}_runs")


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def _metrics(run: Path) -> list[dict]:
    return read_metrics(run / "metrics.jsonl")


def _timeless_metrics(run: Path) -> list[dict]:
    """The run's metrics without the wall-clock step times, which differ between identical runs."""
    return [{k: v for k, v in row.items() if k != "step_time_s"} for row in _metrics(run)]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(_checkpoint(run, step) / "trainable.safetensors"))


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp_shards_the_trainable_component_over_the_ranks(runs, mode):
    _, reports, log = runs
    ddp, fsdp = reports[f"{mode}/ddp"], reports[f"{mode}/fsdp"]
    assert [r["sharded"] for r in ddp] == [False, False]
    assert [r["sharded"] for r in fsdp] == [True, True]
    total = fsdp[0]["total"]
    assert all(r["local"] == r["total"] == total for r in ddp)
    # Every parameter is split along dim 0: the two shards add up to the whole, each about half of it.
    assert sum(r["local"] for r in fsdp) == total
    assert all(0.4 * total < r["local"] < 0.6 * total for r in fsdp)
    # The load log says so at a glance, in one unit.
    found = re.findall(r"\(trainable\):.*\((\d+\.\d+)(\w?) local of (\d+\.\d+)(\w?) trainable params\)", log)
    halves = [float(n) / float(m) for n, nu, m, mu in found if nu == mu]
    assert len(halves) == len(found) and any(0.4 < h < 0.6 for h in halves), found


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp_first_ratio_is_exactly_one_and_first_kl_exactly_zero(runs, mode):
    out, _, _ = runs
    first = _metrics(out / mode / "fsdp")[0]
    assert first["step"] == 1
    assert first["ratio_mean"] == 1.0
    assert first["approx_kl"] == 0.0
    assert (
        first["kl"] == 0.0
    )  # the reference (adapters off / the sharded frozen copy) is the policy at step 1
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp_weights_after_two_steps_equal_ddp_within_fp32_tolerance(runs, mode):
    out, _, _ = runs
    base = _weights(out / mode / "ddp", 1)  # moved by one step; compare the second step's movement
    ddp, fsdp = _weights(out / mode / "ddp", 2), _weights(out / mode / "fsdp", 2)
    assert ddp.keys() == fsdp.keys()
    moved = max((ddp[k] - base[k]).abs().max().item() for k in ddp)
    diff = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    assert moved > 100 * WEIGHT_ATOL  # the comparison means something: training moved the weights
    assert diff <= WEIGHT_ATOL, f"max |ddp - fsdp| = {diff:.3g} (step 2 moved weights by up to {moved:.3g})"
    # The same weights sample the same images: step 0's evaluation is identical, sharded or not.
    ddp_eval, fsdp_eval = (_metrics(out / mode / s) for s in ("ddp", "fsdp"))
    assert ddp_eval[0]["reward_mean"] == fsdp_eval[0]["reward_mean"]  # same first rollout
    assert "eval/reward_mean" in fsdp_eval[-1]


# Runs that load the whole pipeline on every rank, then shard, beside the default's (read into shards).
WHOLE_LOAD = {"dit": ("full/fsdp", "full/fsdp-whole-load"), "ar": ("lora/fsdp", "lora/fsdp-per-unit")}


@pytest.mark.parametrize("kind", list(WHOLE_LOAD))
def test_loading_into_shards_gives_the_run_of_a_whole_load_bit_for_bit(request, kind):
    """The trained component built empty, sharded, and each rank's shards read from the safetensors files
    (the DiT's full fine-tune with its KL reference read the same way; the AR model's LoRA adapters drawn as
    in a whole load) trains exactly as the whole pipeline loaded by every rank, then sharded (the AR run
    also samples per unit, which may not change a number either). The DiT's offloaded reference is read
    into host-memory shards: `test_reference_offload_and_per_unit_sampling_give_the_same_run`."""
    out, reports, log = request.getfixturevalue(f"{kind}_runs")
    into_shards, whole = WHOLE_LOAD[kind]
    assert [r["read_into_shards"] for r in reports[into_shards]] == [True, True]
    assert [r["read_into_shards"] for r in reports[whole]] == [False, False]
    assert "tensors read into this rank's shards" in log
    assert _timeless_metrics(out / into_shards) == _timeless_metrics(out / whole)
    for step in (1, 2):
        a, b = _weights(out / into_shards, step), _weights(out / whole, step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", list(MODES))
def test_fsdp_resume_is_bit_exact(runs, mode):
    out, _, _ = runs
    straight, resumed = out / mode / "fsdp", out / mode / "resumed"
    a, b = _weights(straight, 2), _weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = (
        torch.load(_checkpoint(r, 2) / "optimizer.pt", weights_only=True) for r in (straight, resumed)
    )
    assert opt_a["state"].keys() == opt_b["state"].keys()  # keyed by parameter name under fsdp
    assert all(isinstance(k, str) for k in opt_a["state"])
    for name, state in opt_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, opt_b["state"][name][key]), (name, key)
    assert _timeless_metrics(straight)[-1] == _timeless_metrics(resumed)[-1]
    state = json.loads((_checkpoint(straight, 2) / "trainer_state.json").read_text())
    assert state["sharded"] is True


def test_fsdp_checkpoint_exports_to_plain_diffusers(runs, tmp_path):
    from diffusers import GlmImagePipeline

    out, _, _ = runs
    checkpoint = _checkpoint(out / "full" / "fsdp", 2)
    assert export_main(["--checkpoint", str(checkpoint), "--output", str(tmp_path / "export")]) == 0
    pipe = GlmImagePipeline.from_pretrained(tmp_path / "export")
    trained = load_file(str(checkpoint / "trainable.safetensors"))
    component = pipe.transformer if "transformer_blocks.0.attn1.to_q.weight" in trained else None
    component = component or pipe.vision_language_encoder
    params = dict(component.named_parameters())
    assert trained.keys() <= params.keys()
    assert all(torch.equal(params[k].detach(), v) for k, v in trained.items())


def test_bf16_policy_with_checkpointing_computes_in_bf16_with_the_first_ratio_exactly_one(dit_runs):
    out, reports, _ = dit_runs
    assert [r["dtypes"] for r in reports["lora/fsdp"]] == [["torch.float32"]] * 2
    assert [r["dtypes"] for r in reports["lora/fsdp-bf16"]] == [["torch.bfloat16"]] * 2
    # The policy casts weights, not inputs: the DiT's timestep stays float32 (in bf16 986.3 would be 988).
    assert [r["input_dtypes"]["timestep"] for r in reports["lora/fsdp-bf16"]] == [["torch.float32"]] * 2
    first = _metrics(out / "lora" / "fsdp-bf16")[0]
    assert first["ratio_mean"] == 1.0 and first["approx_kl"] == 0.0 and first["kl"] == 0.0
    # The sharded master weights stay fp32 and train.
    weights = _weights(out / "lora" / "fsdp-bf16", 2)
    assert {v.dtype for v in weights.values()} == {torch.float32}


def test_reference_offload_and_per_unit_sampling_give_the_same_run(dit_runs):
    out, _, _ = dit_runs
    on_device, offloaded = (_timeless_metrics(out / "full" / name) for name in ("fsdp", "fsdp-offload"))
    assert offloaded == on_device and on_device[-1]["kl"] > 0


def test_ar_generation_runs_in_lockstep_and_per_unit_sampling_gives_the_same_run(ar_runs):
    out, reports, _ = ar_runs
    # transformers' generate() sees an FSDP-managed model: synced_gpus, no rank stops stepping early.
    assert [r["synced_generation"] for r in reports["lora/fsdp"]] == [True, True]
    assert [r["synced_generation"] for r in reports["lora/ddp"]] == [False, False]
    gathered, per_unit = (_timeless_metrics(out / "lora" / name) for name in ("fsdp", "fsdp-per-unit"))
    assert per_unit == gathered


def test_resuming_across_strategies_is_refused_with_the_fix(dit_runs):
    _, reports, _ = dit_runs
    for rank_report in reports["full/ddp-from-fsdp!error"]:
        assert "trainer.strategy=fsdp" in rank_report["error"]  # the fix: resume with the writer's strategy

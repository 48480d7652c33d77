"""The seeds' scenario table, on a real tiny GLM-Image saved to disk and reloaded with `from_pretrained`.

Seed 000: `.to()` on a model placed by a device map (meta tensors) -> never called unless the map is "cpu".
Seed 001: a `device_map` under distributed training -> distributed always loads on CPU, then moves.
Seed 002: hangs while loading -> no offload options; every stage under a timeout that names it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from accelerate import init_empty_weights

from glm_training.config import ModelConfig
from glm_training.distributed.collectives import detect_distributed
from glm_training.models.placement import (
    MetaTensorError,
    PlacementError,
    StageTimeoutError,
    check_no_meta,
    move_to_device,
    pipeline_load_kwargs,
    plan_placement,
    run_stage,
)
from glm_training.models.wrapper import GLMImageWrapper, load_for_training

CPU = torch.device("cpu")


class MoveSpy:
    """Records calls to the real `GLMImageWrapper.to` (the method still runs)."""

    def __init__(self, monkeypatch):
        self.calls: list = []
        real = GLMImageWrapper.to

        def spy(wrapper, device):
            self.calls.append(torch.device(device))
            return real(wrapper, device)

        monkeypatch.setattr(GLMImageWrapper, "to", spy)


def _cfg(tiny_model_dir, device_map: str) -> ModelConfig:
    return ModelConfig(name=str(tiny_model_dir), device_map=device_map, stage_timeout_s=120)


@pytest.mark.parametrize("device_map", ["auto", "balanced"])
def test_single_process_map_places_without_to(tiny_model_dir, device_map, monkeypatch):
    spy = MoveSpy(monkeypatch)
    wrapper, plan = load_for_training(
        _cfg(tiny_model_dir, device_map), "dit", distributed=False, reason="test", device=CPU
    )
    assert not plan.distributed
    assert plan.move_to is None and spy.calls == []  # no .to() of a model a device map placed
    assert plan.load_device_map in ("cpu", "balanced")  # "auto" is never handed to diffusers
    for module in wrapper.components().values():
        assert all(p.device.type == "cpu" for p in module.parameters())
    assert all(p.requires_grad for p in wrapper.trainable.parameters())
    assert not any(p.requires_grad for m in wrapper.frozen().values() for p in m.parameters())


def test_single_process_cpu_map_loads_on_cpu_then_moves(tiny_model_dir, monkeypatch):
    spy = MoveSpy(monkeypatch)
    wrapper, plan = load_for_training(
        _cfg(tiny_model_dir, "cpu"), "ar", distributed=False, reason="t", device=CPU
    )
    assert plan.load_device_map == "cpu" and spy.calls == [CPU]
    assert wrapper.trainable is wrapper.pipeline.vision_language_encoder
    # pad_token_id is set directly (no GenerationConfig reload).
    assert wrapper.trainable.generation_config.pad_token_id is not None


@pytest.mark.parametrize(
    "env",
    [{"WORLD_SIZE": "2"}, {"RANK": "0"}, {"LOCAL_RANK": "0"}, {"ACCELERATE_USE_DEEPSPEED": "true"}],
    ids=["WORLD_SIZE", "RANK", "LOCAL_RANK", "deepspeed"],
)
@pytest.mark.parametrize("device_map", ["auto", "balanced", "cuda"])
def test_distributed_detection_forces_cpu_load_then_move(tiny_model_dir, env, device_map, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    distributed, reason = detect_distributed()
    assert distributed, reason
    assert next(iter(env)) in reason or "DeepSpeed" in reason
    spy = MoveSpy(monkeypatch)
    # The configured map (even "cuda" on a machine without one) is ignored: distributed loads on CPU.
    wrapper, plan = load_for_training(
        _cfg(tiny_model_dir, device_map), "dit", distributed=distributed, reason=reason, device=CPU
    )
    assert plan.distributed and plan.load_device_map == "cpu" and plan.max_memory is None
    assert spy.calls == [CPU]
    assert all(p.device == CPU for p in wrapper.trainable.parameters())


def test_no_distributed_environment_is_single_process():
    assert detect_distributed({}) == (False, "no distributed environment variables")
    assert detect_distributed({"WORLD_SIZE": "1"})[0] is False
    assert detect_distributed({}, strategy="fsdp")[0] is True


def test_plan_on_gpus_uses_balanced_with_90_percent(monkeypatch):
    # The plan is pure; give it a machine with two 80 GB GPUs.
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    plan = plan_placement("auto", distributed=False, reason="t", device=torch.device("cuda", 0))
    assert plan.load_device_map == "balanced" and plan.move_to is None
    assert plan.max_memory == {0: int(0.9 * 80 * 2**30), 1: int(0.9 * 80 * 2**30)}
    kwargs = pipeline_load_kwargs(plan, torch.bfloat16)
    assert kwargs["device_map"] == "balanced" and kwargs["max_memory"] == plan.max_memory
    assert not {"offload_state_dict", "offload_folder"} & set(kwargs)  # disk offload hung from_pretrained
    dist_plan = plan_placement("auto", distributed=True, reason="t", device=torch.device("cuda", 1))
    assert dist_plan.load_device_map == "cpu" and dist_plan.move_to == torch.device("cuda", 1)


def test_cuda_map_without_cuda_is_a_clear_error():
    with pytest.raises(PlacementError, match="no CUDA device"):
        plan_placement("cuda", distributed=False, reason="t", device=CPU)


def test_meta_tensors_give_the_clear_error_not_torchs(tiny_model_dir):
    wrapper = GLMImageWrapper(str(tiny_model_dir), "dit")
    # What a device map with offloading leaves behind: a component whose weights were never materialised.
    with init_empty_weights():
        ghost = type(wrapper.trainable).from_config(wrapper.trainable.config)
    wrapper.pipeline.register_modules(transformer=ghost)
    with pytest.raises(MetaTensorError) as err:
        wrapper.to(CPU)
    message = str(err.value)
    assert "transformer:" in message and "device_map=cpu" in message
    assert "Cannot copy out of meta tensor" in message  # explains what it prevented...
    assert isinstance(err.value.__context__, type(None))  # ...without torch's error ever being raised
    with pytest.raises(MetaTensorError):
        check_no_meta({"transformer": ghost})
    with pytest.raises(MetaTensorError):
        move_to_device({"transformer": ghost}, CPU)


def test_a_hanging_stage_fails_with_its_name():
    release = threading.Event()
    finished = []

    def hanging_stage() -> None:
        release.wait(60)  # until the test releases it; the 60 s only bound a broken run_stage
        finished.append(True)

    with pytest.raises(StageTimeoutError, match="'read weights' did not finish within"):
        run_stage("read weights", hanging_stage, timeout_s=0.3)
    assert not finished  # the error came while the stage still hung
    release.set()


def test_stage_errors_propagate_unchanged():
    def boom():
        raise FileNotFoundError("no checkpoint")

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_stage("load", boom, timeout_s=5)
    assert run_stage("add", lambda: 1 + 1, timeout_s=5) == 2


def test_a_folder_that_is_not_a_pipeline_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        GLMImageWrapper(str(tmp_path), "dit")


def test_loading_logs_each_stage_and_where_each_component_landed(tiny_model_dir, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="glm_training"):
        load_for_training(_cfg(tiny_model_dir, "cpu"), "dit", distributed=False, reason="test", device=CPU)
    lines = [r.getMessage() for r in caplog.records]
    assert any("placement: single process" in line and "device_map='cpu'" in line for line in lines)
    assert any(line.startswith("[load] from_pretrained") and "done in" in line for line in lines)
    for component in ("vision_language_encoder", "text_encoder", "transformer", "vae"):
        (line,) = [ln for ln in lines if ln.startswith(f"[load] {component}:")]
        assert "device cpu" in line and "dtype float32" in line and "params" in line

"""`Policy`: the half of GLM-Image that trains, and everything built around it, in one place.

Its constructor loads GLM-Image and places it on this process's device(s) following the plan (never by luck,
`models/placement.py`), sets up LoRA or full fine-tuning (the KL reference: adapters disabled, or a frozen
copy), float32 masters, the strategy's shards, EMA, the optimizer and its schedule, and the strategy's
wrapper.
`trainable` is the module rollouts, evaluation and the KL reference call; `model` is what the strategy wrapped
(the training forward passes call it): DDP's wrapper, or the sharded module itself.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any

import torch
from torch import nn

from glm_training.distributed import collectives as dist
from glm_training.distributed.loading import empty_trained_component, local_pipeline_folder, standin_weights
from glm_training.engine.ema import EMASchedule
from glm_training.frozen_weights import apply_weights_source, frozen_weight_sources
from glm_training.models.halves import ModelHalf, model_half
from glm_training.models.lora import adapter_inputs_uncast, adapters_disabled, add_lora_adapters
from glm_training.models.master_weights import computing_like_masters, master_names, upcast_trained_
from glm_training.models.placement import describe_module, run_stage
from glm_training.models.wrapper import (
    GLMImageWrapper,
    compile_blocks,
    enable_gradient_checkpointing,
    load_for_training,
    resolve_model_path,
)

logger = logging.getLogger("glm_training")


class Policy:
    """The trained half: model, reference, masters, EMA, optimizer and schedule (see the module docstring).

    `skip`: frozen components this run never uses, so never loads, and why (`("vision_language_encoder",)`
    when a prior cache gives the DiT its tokens). `pipeline`: an already-built pipeline to train instead of
    loading `model.name` (nothing is loaded or moved), or the `wrapper` of another `Policy` that trains the
    other half of the same pipeline.
    """

    def __init__(
        self,
        cfg: Any,
        component: str,
        accelerator: Any,
        parallel: Any,
        placement_context: tuple[bool, str],
        skip: tuple[tuple[str, ...], str] = ((), ""),
        pipeline: Any = None,
    ):
        self.cfg = cfg
        self.component = component
        self.half: ModelHalf = model_half(component)
        self.accelerator = accelerator
        self.parallel = parallel
        self.placement = None
        if pipeline is None:
            self.wrapper = self._load(placement_context, skip)
        elif isinstance(pipeline, GLMImageWrapper):  # the other half trains too (train_joint.py)
            self.wrapper = GLMImageWrapper.other_half(pipeline, component)
        else:
            self.wrapper = GLMImageWrapper.from_pipeline(pipeline, component)
        if self.wrapper.trained_folder is not None:  # on the meta device until it is sharded
            self.device = parallel.device
        else:
            self.device = next(self.wrapper.trainable.parameters()).device
        self.trainable, self.reference, self.master_names = self._setup_trainable(self.wrapper.trainable)
        # In place, after LoRA and gradient checkpointing are set up and before the optimizer is built over
        # the shards (FSDP); nothing under DDP. A component built empty is read into its shards here.
        weights = self.wrapper.trained_folder
        run_stage(
            "shard the trained component" + (f" and read its shards from {weights}" if weights else ""),
            lambda: parallel.shard(self.trainable, self.reference, weights),
            cfg.model.stage_timeout_s,
        )
        logger.info(
            "[load] %s", describe_module(f"{self.wrapper.trainable_name} (trainable)", self.trainable)
        )
        self.wrapper.trainable = self.trainable
        self.ema, self.ema_schedule = self._build_ema()
        self.optimizer, self.lr_scheduler = self._build_optimizer()  # over the shards, when sharded
        self.model, self.optimizer = parallel.wrap(self.trainable, self.optimizer)
        self.num_skipped_nonfinite = 0  # optimizer steps skipped in the current training step

    @property
    def sharded(self) -> bool:
        """Whether the trained component is sharded over the ranks (FSDP on 2 or more ranks)."""
        return self.parallel.sharded

    # -------------------------------------------------------------------------------------------------
    # Building

    def _load(
        self, placement_context: tuple[bool, str], skip: tuple[tuple[str, ...], str]
    ) -> GLMImageWrapper:
        """Load GLM-Image and place it on this process's device(s), following the plan."""
        m = self.cfg.model
        # model.ar_weights / model.dit_weights (chaining the stages) are checked before anything loads.
        sources = frozen_weight_sources(m, self.component, skip[0])
        path = self._resolve_path()
        distributed, reason = placement_context
        wrapper, self.placement = load_for_training(
            m,
            self.component,
            distributed=distributed,
            reason=reason,
            device=dist.choose_device(self.accelerator.local_process_index),
            model_path=path,
            skip_components=skip[0],
            skip_reason=skip[1],
            build_empty=empty_trained_component if self.parallel.loads_into_shards else None,
        )
        for source in sources:
            apply_weights_source(wrapper.pipeline, source)
        return wrapper

    def _resolve_path(self) -> str:
        """`model.name` as a local folder. Rank 0 first: it builds the tiny model (transformers writes weights
        only on rank 0) or fetches the checkpoint; the other ranks then find it complete. Bounded by the
        stage timeout. An error must not skip the block's barrier (the other ranks would wait there until the
        process-group timeout): it is raised after the block, where every rank is released."""
        m = self.cfg.model
        path, error = None, None
        with self.accelerator.main_process_first():
            try:
                path = run_stage(
                    f"resolve model '{m.name}'",
                    lambda: resolve_model_path(m.name, m.tiny_seed, m.shape_layers()),
                    m.stage_timeout_s,
                )
                if self.parallel.loads_into_shards:
                    # The trained component's files are read shard by shard, not by from_pretrained (which
                    # would not fetch a component it is told to leave out): a hub id's whole snapshot,
                    # fetched once, on rank 0; every rank then loads from the local folder.
                    path = str(
                        run_stage(
                            f"fetch '{path}' into the local cache",
                            lambda: local_pipeline_folder(path),
                            m.stage_timeout_s,
                        )
                    )
            except Exception as err:  # noqa: BLE001  (re-raised below, outside the barrier)
                error = err
        if error is not None:
            raise error
        return path

    def _setup_trainable(self, module: nn.Module) -> tuple[nn.Module, nn.Module | None, set[str]]:
        """LoRA adapters (peft, injected in place so the pipeline keeps its classes) or full fine-tuning;
        returns (the module, the frozen reference copy or None, the names of float32 master weights)."""
        lora = self.cfg.model.lora
        reference = None
        if lora.enabled:
            # On an empty component (loaded into shards later) peft's adapters need real base weights.
            with standin_weights(module):
                add_lora_adapters(module, lora)
        else:
            for sub in self.half.trained_parts(module):
                sub.requires_grad_(True)
            if self.cfg.algo.uses_reference():
                # Full fine-tuning: the reference is a frozen copy of the base weights.
                reference = copy.deepcopy(module).requires_grad_(False).eval()
        # Parameters outside the submodules the forward pass uses (e.g. LoRA adapters a target name put into
        # the AR model's vision tower) stay frozen: they would get no gradient, which DDP refuses.
        used = {id(p) for sub in self.half.trained_parts(module) for p in sub.parameters()}
        for p in module.parameters():
            if id(p) not in used:
                p.requires_grad_(False)
        masters = self._upcast_masters(module)
        module.eval()  # no dropout: the recomputed log-probs must equal the rollout's
        if self.cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(module)  # works in eval mode too
        if self.cfg.model.compile_blocks:
            logger.info(
                "[load] %s: %d blocks compiled (model.compile_blocks)",
                self.half.attribute,
                compile_blocks(module),
            )
        if sum(p.numel() for p in module.parameters() if p.requires_grad) == 0:
            raise ValueError(
                f"no trainable parameters in the {self.component} model: model.lora.target_modules="
                f"{list(lora.target_modules)} matched nothing; name modules that exist in it."
            )
        return module, reference, masters

    def _upcast_masters(self, module: nn.Module) -> set[str]:
        """Float32 masters of a bf16 / fp16 full fine-tune (`models/master_weights.py`); after the reference
        copy, which stays in the model's dtype."""
        if not self.cfg.model.keeps_master_weights():
            return set()
        upcast = upcast_trained_(module)
        logger.info(
            "[load] %s: %s trained parameters in float32 (master weights), computed in %s "
            "(trainer.mixed_precision); the rest stays %s",
            self.half.attribute,
            f"{upcast:,}",
            self.cfg.model.dtype,
            self.cfg.model.dtype,
        )
        return master_names(module)

    def _build_ema(self):
        """diffusers' `EMAModel` holds the shadow weights; `EMASchedule` updates them as the references do."""
        a = self.cfg.algo
        if not a.ema:
            return None, None
        from diffusers.training_utils import EMAModel

        schedule = EMASchedule(a.ema_decay, a.ema_update_interval, a.ema_calls, a.ema_train_batch_size)
        return EMAModel(self.trained_parameters(), decay=a.ema_decay), schedule

    def _build_optimizer(self):
        o = self.cfg.optim
        optimizer = torch.optim.AdamW(
            self.trained_parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        warmup = o.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0
        )
        return optimizer, scheduler

    # -------------------------------------------------------------------------------------------------
    # Using

    def trained_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.trainable.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def precision(self):
        """The numeric precision of every pass of the policy: sampling, old log-probs, update, reference.

        All of them run inside this one context (accelerate's autocast for `trainer.mixed_precision`), so
        they compute in the same precision by construction: an unprepared module (the frozen reference copy
        of full fine-tuning, the policy called outside `model`) would otherwise run in its parameters'
        dtype while the prepared policy runs under autocast, and the first ratio / KL would not be exact.
        Under autocast the LoRA layers skip peft's cast of their input (`adapter_inputs_uncast`: the same
        numbers, two copies fewer per layer).
        """
        with self.accelerator.autocast(), adapter_inputs_uncast(self.trainable, self.device.type):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    @contextlib.contextmanager
    def reference_model(self):
        """The KL reference: the same module with LoRA adapters disabled, or the frozen copy."""
        if self.reference is None:
            with adapters_disabled(self.trainable) as module:
                yield module
            return
        # Beside float32 masters it computes with their values, as the policy does (FSDP casts both).
        like_masters = self.master_names and not self.parallel.sharded
        with (
            computing_like_masters(self.reference, self.master_names)
            if like_masters
            else contextlib.nullcontext()
        ):
            yield self.reference

    def ema_calls(self, num_samples: int | None, num_steps: int, num_passes: int) -> list[int]:
        """The evaluation EMA's calls at each optimizer step of an update of `num_passes` passes of
        `num_steps` steps over this rank's `num_samples` samples, as the reference counts them
        (`engine/ema.py`, `algo.ema_calls`); all 0 without an EMA."""
        if self.ema is None:
            return [0] * (num_steps * num_passes)
        return self.ema_schedule.calls(num_samples, num_steps, num_passes)

    def optimizer_step(self, num_ema_calls: int = 1) -> float:
        """Clip, step, schedule, zero, and the step's `num_ema_calls` calls of the EMA around it
        (`engine/ema.py`, `ema_calls`); returns the pre-clip gradient norm.

        A non-finite norm (a NaN/inf loss or an overflow) makes no update: no optimizer, LR schedule or EMA
        step (see `guards.py`). Under DDP the norm comes from all-reduced gradients: every rank agrees.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(self.parallel.clip_grad_norm_(params, self.cfg.optim.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.num_skipped_nonfinite += 1
            if self.accelerator.scaler is not None:
                self.optimizer.step()  # fp16: the grad scaler skips the update itself and lowers its scale
            self.optimizer.zero_grad(set_to_none=True)
            logger.warning("gradient norm is %s: optimizer step skipped (no update)", grad_norm)
            return grad_norm
        steps = self.lr_scheduler.last_epoch  # optimizer steps taken so far (checkpoints restore it)
        if self.ema is not None:
            self.ema_schedule.before_step(
                self.ema.shadow_params, self.trained_parameters(), steps, num_ema_calls
            )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema_schedule.after_step(
                self.ema.shadow_params, self.trained_parameters(), steps + 1, num_ema_calls
            )
            self.ema.optimization_step = steps + 1
        return grad_norm

    def weights_finite(self) -> bool:
        """Whether this rank's trained weights (its shards, under FSDP) are all finite: one device sync."""
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.trained_parameters()]
        return bool(torch.stack([torch.isfinite(p.detach()).all() for p in local]).all())

    @contextlib.contextmanager
    def eval_weights(self):
        """The EMA weights inside, when EMA is on (as Flow-GRPO evaluates); the live weights otherwise."""
        if self.ema is None:
            yield
            return
        params = self.trained_parameters()
        # diffusers' store() keeps a CPU copy; a sharded parameter (DTensor) stays where its shard is, so it
        # is copied in place, on its device (1/world of the weights).
        sharded = self.parallel.sharded
        stored = [p.detach().clone() for p in params] if sharded else self.ema.store(params)
        self.ema.copy_to(params)
        try:
            yield
        finally:
            if sharded:
                with torch.no_grad():
                    for param, value in zip(params, stored):
                        param.copy_(value)
            else:
                self.ema.restore(params)

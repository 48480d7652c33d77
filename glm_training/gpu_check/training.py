"""One LoRA training step of each half (`dit`: Flow-GRPO, `recipes/flow_grpo_fast_ocr`; `ar`: GRPO/DAPO,
`recipes/dapo_aesthetic_alignment`) through the project's own trainer, around the pipeline built in memory:
seconds of the step and of its rollout and update, peak memory next to `glm_training.plan`'s prediction, and
for the DiT the update's model FLOPs and MFU.

The trainers are built from the real-model recipes (`model=glm_image_shape` with `--toy`) with one group of
two samples, the JPEG reward (no reward weights to download) and the bundled prompts; `--dit-overrides` /
`--ar-overrides` add config overrides. Only where the model comes from differs: the trainer is handed the
pipeline built here (`RewardTrainer(cfg, pipeline=...)`) instead of loading a folder, so nothing is written to
disk; the checkpoint at the end of the step is skipped. The DiT step's prior tokens are seeded random codebook
ids, as a prior cache (`data.prior_cache`) hands them over, so that step times the DiT alone.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glm_training.gpu_check.measure import GIB, compiled_graphs, free_memory, measured, profiled
from glm_training.gpu_check.settings import Settings

# One step of one group of two samples, the bundled prompts (`data.prompt_file=`), a reward without weights.
COMMON_OVERRIDES = [
    "data.prompt_file=",
    "reward.names=[jpeg_compressibility]",
    "data.num_groups_per_step=1",
    "data.num_generations=2",
    "eval.every_n_steps=0",
    "trainer.num_steps=1",
    "logging.tensorboard=false",
    "trainer.progress_bar=false",
]


def _in_memory_trainer() -> type:
    """The engine's trainer of a given pipeline (`pipeline=`: no folder, no `.to()`), with the rollout and the
    update timed and their peak memory measured, and no checkpoint written."""
    from glm_training.engine.trainer import RewardTrainer

    class InMemoryTrainer(RewardTrainer):
        def __init__(self, cfg, pipeline, priors=None) -> None:
            self.phases: dict[str, dict[str, float]] = {}
            super().__init__(cfg, pipeline=pipeline, priors=priors)

        def _timed(self, phase: str, fn: Callable[[], Any]) -> Any:
            if phase in self.phases:  # a later step: the first step's figures stay as first_<phase>
                self.phases.setdefault(f"first_{phase}", self.phases[phase])
            with measured(self.policy.device) as self.phases[phase]:
                return fn()

        def collect(self, step: int):
            return self._timed("rollout", lambda: super(InMemoryTrainer, self).collect(step))

        def update(self, batch, step: int) -> dict[str, float]:
            self.update_stats = self._timed(
                "update", lambda: super(InMemoryTrainer, self).update(batch, step)
            )
            return self.update_stats

        def save(self, step: int, at_once: bool = True) -> None:
            pass  # the check writes no checkpoint

    return InMemoryTrainer


class RandomPriors:
    """The DiT step's prior tokens: seeded random codebook ids, as a prior cache (`data.prior_cache`) hands
    them over, so that the step times the DiT alone (the AR step times the AR rollout)."""

    def __init__(self, pipe, height: int, width: int):
        self.vocab = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
        self.length = (height // 16) * (width // 16)
        self.eval_tokens = None  # evaluation (off in the check) would sample its own

    def step_tokens(self, texts: list[str], seed: int, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return torch.randint(self.vocab, (len(texts), self.length), generator=generator)

    def initial_latents(self) -> None:
        return None  # the rollout draws its own noise


DEFAULT_RECIPES = {"dit": "recipes/flow_grpo_fast_ocr", "ar": "recipes/dapo_aesthetic_alignment"}


def training_config(
    component: str, settings: Settings, output_dir: Path, recipe: str | None = None, extra: Sequence[str] = ()
):
    """`recipe` (default: the half's `DEFAULT_RECIPES`) shrunk to one step of one group of two samples
    (module docstring); `extra` overrides come last."""
    from glm_training.config import load_config

    shrink = settings.toy and recipe is None  # the toy's shorter schedules; a recipe row keeps its own
    recipe = recipe or DEFAULT_RECIPES[component]
    size = settings.train_size
    overrides = [
        *COMMON_OVERRIDES,
        f"trainer.output_dir={output_dir}",
        f"sampling.height={size}",
        f"sampling.width={size}",
    ]
    bf16 = settings.dtype == torch.bfloat16
    if settings.toy:
        overrides += ["model=glm_image_shape"]
    overrides += [
        f"model.dtype={'bfloat16' if bf16 else 'float32'}",
        f"trainer.mixed_precision={'bf16' if bf16 else 'no'}",
    ]
    if component == "dit":
        if shrink:
            overrides += [
                "sampling.num_steps=2",
                "sampling.sde_window_size=1",
                "sampling.sde_window_range=[0,1]",
            ]
    else:
        # The toy on a CPU: one DiT step, and no compiling (minutes at the real widths on a CPU).
        toy = ["sampling.dit_num_steps=1", "sampling.compile=false"] if settings.toy else []
        overrides += ["algo.micro_batch_size=2", *toy]
    overrides += [*settings.overrides.get(component, []), *extra]
    return recipe, load_config(config=recipe, overrides=overrides)


def train_step(
    component: str,
    pipe,
    settings: Settings,
    matmul_flops: float | None,
    spec_flops: float | None,
    recipe: str | None = None,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One training step of `component`'s half through its trainer (`recipe`, `extra`: see
    `training_config`): times, peak memory, the plan's figure.

    The pipeline is handed back as it was (`_hand_back`) however the step ends."""
    trainer_cls = _in_memory_trainer()
    attribute = "transformer" if component == "dit" else "vision_language_encoder"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        section_step = recipe is None  # the dit / ar section's own step, not a recipe row
        recipe, cfg = training_config(component, settings, Path(tmp) / "run", recipe, extra)
        trainer = None
        try:
            priors = (
                RandomPriors(pipe, settings.train_size, settings.train_size) if component == "dit" else None
            )
            trainer = trainer_cls(cfg, pipe, priors)
            graphs = compiled_graphs()
            wanted = component in settings.profile and section_step
            profile = settings.output / f"profile_{component}.txt" if wanted else None
            with profiled(settings.device, profile), measured(settings.device) as step:
                trainer.train()
            graphs = compiled_graphs() - graphs
            result = _step_result(component, recipe, cfg, settings.train_size, trainer, step, graphs)
            if component == "dit" and cfg.algo.name == "flow_grpo":  # the count is Flow-GRPO's update
                seconds = trainer.phases["update"]["seconds"]
                result.update(dit_update_flops(trainer, pipe, seconds, matmul_flops, spec_flops))
            return result
        finally:
            _hand_back(pipe, attribute, trainer)
            del trainer
            free_memory(settings.device)


def _step_result(
    component: str, recipe: str, cfg, size: int, trainer, step: dict[str, Any], graphs: int
) -> dict[str, Any]:
    """The figures of a finished step of `size`² images: `step` is its `measured` dict, `graphs` what it
    compiled."""
    record = json.loads((trainer.output_dir / "metrics.jsonl").read_text().splitlines()[-1])
    plan = trainer.memory_plan
    phases = trainer.phases
    return {
        "component": component,
        "recipe": recipe,
        "driven_by": f"{type(trainer).__name__}.train(), {cfg.trainer.num_steps} step(s)",
        "height": size,
        "width": size,
        "samples": cfg.data.per_rank_samples(1),
        "step_seconds": step["seconds"],
        "phases": phases,
        # Each phase resets the peak counter as it starts: the step's peak is the largest.
        "peak_memory_gib": max(p["peak_memory_gib"] for p in [step, *phases.values()]),
        "peak_memory_source": step["peak_memory_source"],
        "loss": record.get("loss"),
        # The last step's sampler-learner gap and first ratio (the AR half; None for the DiT).
        **{key: record.get(key) for key in ("sampling_logp_mean_diff", "sampling_logp_max_diff")},
        "ratio_mean": record.get("ratio_mean"),
        "num_steps": cfg.trainer.num_steps,
        "plan_peak_gib": plan.peak / GIB if plan else None,
        "plan_summary": plan.summary() if plan else None,
        "trainable_params": sum(p.numel() for p in trainer.policy.trained_parameters()),
        "graphs_compiled": graphs,
    }


def _hand_back(pipe, attribute: str, trainer) -> None:
    """Hand the pipeline's `attribute` back as it was: no autocast wrapper, no adapters, no checkpointing,
    no compiled blocks, frozen (`trainer` None: it was never built)."""
    from glm_training.models.lora import merge_lora_adapters, tuner_layers

    module = getattr(pipe, attribute)
    if trainer is not None:
        module = trainer.accelerator.unwrap_model(trainer.policy.model, keep_fp32_wrapper=False)
    if tuner_layers(module):
        merge_lora_adapters(module, merge=False)
    # (flag, switch) of diffusers' gradient checkpointing, then transformers' activation checkpointing
    for flag, off in (
        ("is_gradient_checkpointing", "disable_gradient_checkpointing"),
        ("is_activation_checkpointing", "activation_checkpointing_disable"),
    ):
        if hasattr(module, off) and getattr(module, flag, False):
            getattr(module, off)()
    for sub in module.modules():  # model.compile_blocks compiled them in place (nn.Module.compile)
        sub._compiled_call_impl = None
    module.requires_grad_(False).eval()
    pipe.register_modules(**{attribute: module})


def dit_update_flops(
    trainer, pipe, seconds: float, matmul_flops: float | None, spec_flops: float | None
) -> dict[str, Any]:
    """Model FLOPs of the DiT update and its MFU, counted in full: linear layers and attention, with the
    recompute of gradient checkpointing apart.

    Per forward of one image: linear 2 N T (N = the DiT's matmul weights, every nn.Linear; T = latent
    tokens of an image), attention 4 T² d L (scores and values; d = heads x head dim, L = blocks). A policy
    forward adds its backward: the input gradients of the frozen weights, 2 N T, and attention's 8 T² d L;
    a reference forward (beta > 0) is a forward. Policy forwards = samples x trained steps x
    inner epochs, x2 with guidance (CFG's second pass). Gradient checkpointing recomputes each policy
    forward: `recompute_flops`, in the hardware FLOPs (`hfu`), not in the MFU. Left out: LoRA's own
    matmuls, the text tokens' share of attention, elementwise work; so the MFU is a lower bound.
    `mfu_linear` counts the linear layers alone (the figure before attention was counted).
    """
    cfg = trainer.cfg
    dit = pipe.transformer
    n = sum(m.weight.numel() for m in dit.modules() if isinstance(m, nn.Linear))
    patch = dit.config.patch_size * pipe.vae_scale_factor
    tokens = (cfg.sampling.height // patch) * (cfg.sampling.width // patch)
    width = dit.config.num_attention_heads * dit.config.attention_head_dim
    linear, attention = 2 * n * tokens, 4 * tokens**2 * width * len(dit.transformer_blocks)
    cfg_passes = 2 if cfg.sampling.guidance_scale > 1 else 1
    steps = int(trainer.update_stats.get("num_train_steps", 0))
    forwards = cfg.data.per_rank_samples(1) * steps * cfg.algo.num_inner_epochs * cfg_passes
    reference = 1 if cfg.algo.beta > 0 else 0
    flops = forwards * (linear * (2 + reference) + attention * (3 + reference))
    recompute = forwards * (linear + attention) if cfg.model.gradient_checkpointing else 0
    linear_only = forwards * linear * (2 + reference)
    return {
        "update_flops": flops,
        "update_flops_per_s": flops / seconds,
        "attention_share": attention / (linear + attention),
        "recompute_flops": recompute,
        "mfu": flops / seconds / spec_flops if spec_flops else None,
        "hfu": (flops + recompute) / seconds / spec_flops if spec_flops else None,
        "mfu_linear": linear_only / seconds / spec_flops if spec_flops else None,
        "of_measured_matmul": flops / seconds / matmul_flops if matmul_flops else None,
    }

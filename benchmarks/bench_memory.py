"""Memory of a training step on the real-width fixture (`model=glm_image_shape`) against `glm_training.plan`.

    python benchmarks/bench_memory.py --calibrate            # activation coefficients of glm_training/plan/
    python benchmarks/bench_memory.py --component dit --size 512 --num-layers 1   # one case, prints JSON
    python benchmarks/bench_memory.py --all                  # every case of docs/benchmarks.md

--calibrate counts the bytes saved for backward (saved-tensor hooks, unique storages, parameters excluded)
by a bf16-autocast LoRA forward with 1 and 2 layers (the one block applied twice), with and without gradient
checkpointing, and prints the per-layer coefficient in bytes per token per unit of width.

A case loads the fixture with `from_pretrained` (bf16), copies the memory-mapped weights into process
memory (as a move to the GPU would; otherwise only the pages a step reads count), adds the trainer's LoRA
adapters, and runs one update (forward, backward, AdamW step) of one micro-batch at the given resolution, in
a fresh subprocess. It reports the peak RSS during the step minus the RSS before loading (VmHWM, reset after
loading via /proc/self/clear_refs) next to the plan's weights + trainable state + activations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glm_training.config import load_config  # noqa: E402
from glm_training.plan import saved_tensor_bytes  # noqa: E402

GIB = 1024**3


def rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def dit_inputs(transformer, batch: int, size: int):
    h = size // 8
    tokens = (h // 2) ** 2
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(batch, 16, h, h, generator=g, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(
            batch, 16, transformer.config.text_embed_dim, generator=g, dtype=torch.bfloat16
        ),
        prior_token_id=torch.randint(0, 16384, (batch, tokens), generator=g),
        prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
        timestep=torch.full((batch,), 500.0),
        target_size=torch.tensor([[size, size]] * batch, dtype=torch.bfloat16),
        crop_coords=torch.zeros(batch, 2, dtype=torch.bfloat16),
        return_dict=False,
    )


def dit_loss(transformer, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return transformer(**inputs)[0].float().pow(2).mean()


def ar_inputs(ar, batch: int, size: int):
    from glm_training.plan import sequence_tokens

    tokens, scored = sequence_tokens("ar", size, size, {"transformer": None})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 16384, (batch, tokens), generator=g)
    pos = torch.arange(tokens).view(1, 1, -1).expand(3, batch, -1)
    return ids, pos, scored


def ar_loss(ar, inputs):
    ids, pos, scored = inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = ar.model.language_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        logits = ar.lm_head(hidden[:, -scored:]).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -log_probs.gather(-1, ids[:, -scored:, None]).mean()


def _lora(module, component):
    from glm_training.models.lora import add_lora_adapters

    cfg = load_config(
        config="ar_training" if component == "ar" else "t2i_training", overrides=["model=glm_image_shape"]
    )
    add_lora_adapters(module, cfg.model.lora)
    return cfg


def calibrate(size: int = 256) -> dict:
    """Per-layer saved bytes / (tokens x width) with and without checkpointing, from 1 vs 2 layers."""
    from diffusers import GlmImagePipeline

    from glm_training.models.shape import ensure_shape_pipeline
    from glm_training.models.wrapper import enable_gradient_checkpointing

    pipe = GlmImagePipeline.from_pretrained(ensure_shape_pipeline(1, 1), dtype=torch.bfloat16)
    out = {}
    for component in ("dit", "ar"):
        module = pipe.transformer if component == "dit" else pipe.vision_language_encoder
        _lora(module, component)
        module.eval()
        layers_owner = module if component == "dit" else module.model.language_model
        attr = "transformer_blocks" if component == "dit" else "layers"
        block = getattr(layers_owner, attr)[0]
        inputs = dit_inputs(module, 1, size) if component == "dit" else ar_inputs(module, 1, size)
        loss_fn = dit_loss if component == "dit" else ar_loss
        if component == "dit":
            tokens, width = (
                (size // 16) ** 2,
                module.config.num_attention_heads * module.config.attention_head_dim,
            )
        else:
            tokens, width = inputs[0].shape[1], module.config.text_config.hidden_size
        figures = {}
        for ckpt in (False, True):
            if ckpt:
                enable_gradient_checkpointing(module)
            saved = []
            for n in (1, 2):
                setattr(layers_owner, attr, torch.nn.ModuleList([block] * n))
                if component == "ar":
                    module.config.text_config.num_hidden_layers = n
                    layers_owner.config.num_hidden_layers = n
                with saved_tensor_bytes(list(module.parameters())) as seen:
                    loss = loss_fn(module, inputs)
                saved.append(sum(seen.values()))
                del loss
            per_layer = saved[1] - saved[0]
            figures["ckpt" if ckpt else "full"] = {
                "saved_1_layer": saved[0],
                "saved_2_layers": saved[1],
                "coef_per_layer": per_layer / (tokens * width),
                "base_bytes": saved[0] - per_layer,
            }
        out[component] = {"size": size, "tokens": tokens, "width": width, **figures}
    return out


def run_case(component: str, size: int, num_layers: int, checkpointing: bool, batch: int) -> dict:
    """One update step in this process; returns measured and planned bytes."""
    from diffusers import GlmImagePipeline

    from glm_training.models.shape import ensure_shape_pipeline
    from glm_training.models.wrapper import enable_gradient_checkpointing
    from glm_training.plan import build_plan

    folder = ensure_shape_pipeline(num_layers, num_layers)
    before = rss_bytes()
    pipe = GlmImagePipeline.from_pretrained(folder, dtype=torch.bfloat16)
    # from_pretrained maps the safetensors files: a page counts in RSS only once read, and a DiT step never
    # reads the AR weights. Copy every weight into process memory, as a move to a GPU would.
    for name in ("vision_language_encoder", "transformer", "text_encoder", "vae"):
        for p in getattr(pipe, name).parameters():
            p.data = p.data.clone()
    module = pipe.transformer if component == "dit" else pipe.vision_language_encoder
    cfg = _lora(module, component)
    module.eval()
    if checkpointing:
        enable_gradient_checkpointing(module)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    inputs = dit_inputs(module, batch, size) if component == "dit" else ar_inputs(module, batch, size)
    loss_fn = dit_loss if component == "dit" else ar_loss
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    start = time.perf_counter()
    loss = loss_fn(module, inputs)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    step_s = time.perf_counter() - start
    measured = rss_bytes("VmHWM") - before

    overrides = [
        "model=glm_image_shape",
        f"model.shape_num_ar_layers={num_layers}",
        f"model.shape_num_dit_layers={num_layers}",
        f"model.gradient_checkpointing={str(checkpointing).lower()}",
        f"sampling.height={size}",
        f"sampling.width={size}",
        # The measured step is one forward (no CFG pair) of `batch` samples.
        *(
            ["sampling.guidance_scale=1.0", f"sampling.micro_batch_size={batch}"]
            if component == "dit"
            else []
        ),
        *([f"algo.micro_batch_size={batch}"] if component == "ar" else []),
    ]
    cfg = load_config(config="ar_training" if component == "ar" else "t2i_training", overrides=overrides)
    plan = build_plan(cfg)
    # The step has no rollout, no trajectories and no reward model: compare with those terms left out.
    static = sum(t.bytes for t in plan.static if not t.name.startswith(("trajectory", "reward", "overhead")))
    predicted = static + plan.activations.bytes
    return {
        "component": component,
        "size": size,
        "num_layers": num_layers,
        "checkpointing": checkpointing,
        "batch": batch,
        "measured_gib": measured / GIB,
        "planned_gib": predicted / GIB,
        "error": predicted / measured - 1,
        "step_s": step_s,
    }


def vae_case(size: int, batch: int) -> dict:
    """Peak RSS of decoding `batch` latents to `size`² images with the fixture's (real-layout) VAE, bf16."""
    from diffusers import AutoencoderKL

    from glm_training.models.shape import ensure_shape_pipeline
    from glm_training.plan import VAE_DECODE_BYTES_PER_PIXEL_CHANNEL

    vae = AutoencoderKL.from_pretrained(ensure_shape_pipeline(1, 1) / "vae", dtype=torch.bfloat16).eval()
    latents = torch.randn(batch, 16, size // 8, size // 8, dtype=torch.bfloat16)
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes()
    with torch.no_grad():
        vae.decode(latents, return_dict=False)
    measured = rss_bytes("VmHWM") - before
    return {
        "size": size,
        "batch": batch,
        "measured_gib": measured / GIB,
        "bytes_per_pixel": measured / (batch * size * size),
        "planned_gib": VAE_DECODE_BYTES_PER_PIXEL_CHANNEL
        * vae.config.block_out_channels[0]
        * batch
        * size
        * size
        / GIB,
    }


def real_table(gpu_gb: float = 80.0) -> str:
    """Markdown: the plan of the real GLM-Image (from its configs) for docs/memory_plan.md."""
    from glm_training.plan import build_plan, check_fits

    room = int(gpu_gb * 1e9 * 0.9)
    rows = [
        "| run | size | 1 GPU | 8 GPUs, DDP | 8 GPUs, FSDP |",
        "|---|---|---|---|---|",
    ]
    for component in ("dit", "ar"):
        for lora in (True, False):
            for size in (512, 1024):
                overrides = [
                    "model=glm_image",
                    f"model.lora.enabled={str(lora).lower()}",
                    f"sampling.height={size}",
                    f"sampling.width={size}",
                    "data.num_groups_per_step=8",
                    "data.num_generations=8",
                    "sampling.micro_batch_size=1" if component == "dit" else "algo.micro_batch_size=1",
                ]
                if component == "dit":
                    overrides.append("sampling.num_steps=10")
                cfg = load_config(
                    config="t2i_training" if component == "dit" else "ar_training", overrides=overrides
                )
                cells = []
                for world, strategy in ((1, "ddp"), (8, "ddp"), (8, "fsdp")):
                    plan = build_plan(cfg, world_size=world, strategy=strategy, device_bytes=room)
                    try:
                        check_fits(plan)
                        mark = "fits"
                    except Exception:
                        mark = "**does not fit**"
                    top = plan.largest(1)[0]
                    cells.append(
                        f"{plan.peak / GIB:.1f} GiB, {mark} (largest: {top.name} {top.bytes / GIB:.1f})"
                    )
                name = f"{component.upper()} {'LoRA r32' if lora else 'full'}"
                rows.append(f"| {name} | {size}² | " + " | ".join(cells) + " |")
    return "\n".join(rows)


CASES = [  # (component, size, layers, checkpointing): two sizes x two layer counts each, and checkpointing
    ("dit", 512, 1, False),
    ("dit", 1024, 1, False),
    ("dit", 512, 2, False),
    ("dit", 1024, 2, False),
    ("dit", 1024, 2, True),
    ("ar", 512, 1, False),
    ("ar", 1024, 1, False),
    ("ar", 512, 2, False),
    ("ar", 1024, 2, False),
    ("ar", 1024, 2, True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--vae", action="store_true", help="the rollout's VAE decode peak at --size")
    parser.add_argument(
        "--real-table", action="store_true", help="docs/memory_plan.md's table (configs only)"
    )
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--component", choices=("dit", "ar"), default="dit")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.calibrate:
        print(json.dumps(calibrate(args.size), indent=1))
    elif args.real_table:
        print(real_table())
    elif args.vae:
        print(json.dumps(vae_case(args.size, args.batch)))
    elif args.all:
        for component, size, layers, ckpt in CASES:
            cmd = [
                sys.executable,
                __file__,
                "--component",
                component,
                "--size",
                str(size),
                "--num-layers",
                str(layers),
                "--batch",
                str(args.batch),
            ] + (["--checkpointing"] if ckpt else [])
            result = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            print(
                result.stdout.strip().splitlines()[-1] if result.returncode == 0 else result.stderr[-2000:],
                flush=True,
            )
    else:
        print(
            json.dumps(run_case(args.component, args.size, args.num_layers, args.checkpointing, args.batch))
        )


if __name__ == "__main__":
    main()

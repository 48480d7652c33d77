"""Benchmark of the Flow-GRPO DiT rollout and training step (issue 3). A script to run, not a test.

    HF_HUB_OFFLINE=1 python benchmarks/bench_dit.py                       # tiny model, 64x64, CPU or CUDA
    python benchmarks/bench_dit.py --height 128 --width 128 --json out.json
    python benchmarks/bench_dit.py --model zai-org/GLM-Image --device cuda --dtype bfloat16 \
        --height 1024 --width 1024 --batch 2 --train-steps 2

Measures, on one model with the same steps, resolution, guidance and batch:

1. Denoising: `GlmImagePipeline.__call__(output_type="latent")` with precomputed prior tokens, glyph
   embeddings and initial latents (so the AR model, the text encoder and the VAE are outside the
   timing) against `glm_image_schedule` + `sample_trajectory` on the same inputs, with the SDE (noise
   level 0.7) on every step, recording latents and log-probs. Warm-up once, then the median of
   `--repeats` runs each, taken alternately. The target is rollout <= 1.10x pipeline. A parity check
   (noise level 0 reproduces the pipeline's latents) confirms that both do the same work.
2. Seconds per training step of the real `DiTTrainer` (tiny config + CLI overrides): `collect` (AR prior
   tokens, rollout, VAE decode, rewards, advantages) and `update` timed separately, after a warm-up step.
3. Peak memory: `torch.cuda.max_memory_allocated` per phase on CUDA; on CPU the process's peak RSS
   (`ru_maxrss`), which only grows, so each figure is the peak up to the end of that phase.
4. With `--recipes` (issue 11): batched CFG (one DiT forward of 2B samples) against sequential CFG (two
   of B) in the rollout, interleaved, with the largest latent difference at noise level 0; and the
   Flow-GRPO-Fast window (`--window` SDE steps drawn in the first half, ODE elsewhere) against the full-SDE
   recipe (SDE on every step but the last): two real trainers, their `collect` and `update` timed
   alternately step by step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glm_training.algorithms.decoder.trajectory import sample_trajectory
from glm_training.config import BUNDLED_PROMPTS, load_config  # noqa: E402
from glm_training.models.wrapper import resolve_model_path  # noqa: E402
from glm_training.pipeline.dit import build_guidance_inputs, generate_prior_tokens, glm_image_schedule

NOISE_LEVEL = 0.7
TARGET_RATIO = 1.10
BUSY_CORES = 0.25  # other processes' CPU use above which a CPU timing is flagged as unreliable
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny', a local pipeline folder or a hub id")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="denoising steps")
    p.add_argument("--batch", type=int, default=8, help="images per DiT pass (and per training step)")
    p.add_argument("--guidance", type=float, default=1.5)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per denoising variant")
    p.add_argument(
        "--train-steps",
        type=int,
        default=3,
        help="timed trainer steps after one warm-up step (the trainer "
        "places itself as in training: on CUDA whenever CUDA is present)",
    )
    p.add_argument("--skip-trainer", action="store_true", help="only the denoising comparison")
    p.add_argument(
        "--recipes",
        action="store_true",
        help="only section 4: batched vs sequential CFG, Fast window vs full SDE (issue 11)",
    )
    p.add_argument("--window", type=int, default=2, help="SDE steps of the Fast window (--recipes)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra trainer config override (repeatable), e.g. --override algo.beta=0.04",
    )
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------
# Machine, timing and memory helpers


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")  # environment caps on the CPU code paths


def machine_info(device: torch.device) -> dict:
    """The machine a figure was taken on: CPU model and the flags that decide its speed, threads, versions."""
    from glm_training import environment

    flags = environment.cpu_flags()
    info = {
        "cpu": environment.cpu_model(),
        # The extensions that set CPU speed; without the bf16 ones a bf16 matmul is hundreds of times slower.
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
        "cpu_native_bf16": environment.cpu_has_native_bf16(),
        "isa_caps": {
            k: v for k, v in os.environ.items() if k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
        },
        "cpu_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


class BackgroundLoad:
    """CPU time that *other* processes used while timing, in cores (Linux /proc/stat; None elsewhere).

    The tiny model runs many small parallel regions; when other processes hold the cores, OpenMP threads
    wait on each other and one run can take 10-100x longer, so figures taken under load are not comparable.
    """

    def __init__(self) -> None:
        self.start = self._snapshot()

    @staticmethod
    def _snapshot() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4)) / ticks  # not idle, iowait
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, usage.ru_utime + usage.ru_stime

    def cores(self) -> float | None:
        end = self._snapshot()
        if self.start is None or end is None:
            return None
        wall = end[0] - self.start[0]
        return max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / wall) if wall > 0 else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: max allocated since the last reset. CPU: peak RSS so far (ru_maxrss: KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # macOS reports bytes


def memory_label(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (per phase)"
    return "process peak RSS, ru_maxrss (cumulative: peak up to the end of the phase)"


def prompts_for(batch: int) -> list[str]:
    # The bundled prompts quote no text, so their glyph embeddings have the shape of the empty prompt's,
    # which the pipeline requires of prompt_embeds / negative_prompt_embeds passed together.
    lines = [s.strip() for s in BUNDLED_PROMPTS.read_text(encoding="utf-8").splitlines() if s.strip()]
    return [lines[i % len(lines)] for i in range(batch)]


# ---------------------------------------------------------------------------------------------------------
# 1. Pipeline denoising vs rollout


def denoising_inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(pipeline, its DiT, guidance inputs, initial latents) for `args.batch` bundled prompts."""
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(resolve_model_path(args.model), torch_dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer.eval()
    prompts = prompts_for(args.batch)
    prior = generate_prior_tokens(pipe, prompts, args.height, args.width, seed=args.seed)
    cond = build_guidance_inputs(pipe, prompts, prior, args.height, args.width, args.guidance, device, dtype)
    latent_shape = (
        args.batch,
        transformer.config.in_channels,
        args.height // pipe.vae_scale_factor,
        args.width // pipe.vae_scale_factor,
    )
    latents0 = torch.randn(latent_shape, generator=torch.Generator().manual_seed(args.seed)).to(device)
    return pipe, transformer, cond, latents0


def seeded_rollout(args, inputs, device, *, noise_level, sde_window, batched_cfg=False):
    """The rollout the benchmarks time: `sample_trajectory` from the fixed initial latents and noise seed.

    `inputs` is what `denoising_inputs` returns.
    """
    pipe, transformer, cond, latents0 = inputs
    timesteps, sigmas = glm_image_schedule(pipe, args.steps, args.height, args.width)
    return sample_trajectory(
        transformer,
        latents0.clone(),
        cond,
        timesteps,
        sigmas,
        guidance_scale=args.guidance,
        noise_level=noise_level,
        sde_type="flow_sde",
        sde_window=sde_window,
        generator=torch.Generator(device).manual_seed(args.seed),
        batched_cfg=batched_cfg,
    )


def bench_denoising(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:

    pipe, transformer, cond, latents0 = denoising_inputs(args, device, dtype)

    def run_pipeline() -> torch.Tensor:
        return pipe(
            prompt=None,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            latents=latents0.clone(),
            prompt_embeds=cond.prompt_embeds,
            negative_prompt_embeds=cond.negative_embeds if args.guidance > 1 else None,
            prior_token_ids=cond.prior_token_ids,
            output_type="latent",
            return_dict=False,
        )[0]

    def run_rollout(noise_level: float = NOISE_LEVEL):
        return seeded_rollout(
            args,
            (pipe, transformer, cond, latents0),
            device,
            noise_level=noise_level,
            sde_window=(0, args.steps),
        )

    # Parity (and warm-up): with noise level 0 the rollout must reproduce the pipeline's latents.
    with torch.no_grad():
        ref = run_pipeline()
        det = run_rollout(noise_level=0.0)
    parity = (det.final_latents.float() - ref.float().cpu()).abs().max().item()
    # Same schedule and guidance give identical float32 latents; bf16 only agrees to rounding.
    parity_tol = 1e-5 if dtype == torch.float32 else 5e-2

    reset_peak(device)
    run_pipeline()  # warm-up
    pipe_times = []
    rollout_times = []
    with torch.no_grad():
        run_rollout()  # warm-up
        load = BackgroundLoad()
        for _ in range(args.repeats):  # interleaved, so that drifting machine load hits both alike
            pipe_times.append(timed(run_pipeline, device)[0])
            rollout_times.append(timed(run_rollout, device)[0])
    pipe_s = statistics.median(pipe_times)
    rollout_s = statistics.median(rollout_times)
    result = {
        "pipeline_s": pipe_s,
        "rollout_s": rollout_s,
        "ratio": rollout_s / pipe_s,
        "pipeline_min_s": min(pipe_times),
        "rollout_min_s": min(rollout_times),
        "ratio_of_mins": min(rollout_times) / min(pipe_times),
        "target_ratio": TARGET_RATIO,
        "pipeline_runs_s": pipe_times,
        "rollout_runs_s": rollout_times,
        "parity_max_abs_diff_noise0": parity,
        "parity_ok": parity <= parity_tol,
        "peak_memory_mib": peak_memory_mib(device),
        "background_cores": load.cores(),
        "transformer_params": sum(p.numel() for p in transformer.parameters()),
    }
    return result


# ---------------------------------------------------------------------------------------------------------
# 2. Trainer step


def trainer_overrides(args: argparse.Namespace, output_dir: str) -> list[str]:
    if args.batch < 2:
        raise SystemExit("--batch must be >= 2 for the trainer (GRPO groups need >= 2 samples)")
    generations = 4 if args.batch % 4 == 0 else (2 if args.batch % 2 == 0 else args.batch)
    overrides = [
        f"model.name={args.model}",
        f"model.dtype={args.dtype}",
        f"trainer.output_dir={output_dir}",
        "trainer.progress_bar=false",
        f"trainer.seed={args.seed}",
        f"sampling.height={args.height}",
        f"sampling.width={args.width}",
        f"sampling.num_steps={args.steps}",
        f"sampling.guidance_scale={args.guidance}",
        f"sampling.noise_level={NOISE_LEVEL}",
        f"sampling.micro_batch_size={args.batch}",
        f"data.num_generations={generations}",
        f"data.num_groups_per_step={args.batch // generations}",
    ]
    if args.device == "cpu":
        overrides.append("model.device_map=cpu")
    return overrides + list(args.override)


def bench_trainer(args: argparse.Namespace, device: torch.device) -> dict:
    from glm_training.engine.trainer import DiTTrainer

    with tempfile.TemporaryDirectory(prefix="bench_dit_") as tmp:
        overrides = trainer_overrides(args, str(Path(tmp) / "run"))
        cfg = load_config(overrides, "t2i_training")
        trainer = DiTTrainer(cfg)
        tdev = trainer.policy.device
        reset_peak(tdev)
        collect_s, update_s = [], []
        load = None
        for step in range(args.train_steps + 1):  # step 0 is the warm-up
            if step == 1:
                load = BackgroundLoad()
            c, batch = timed(lambda s=step: trainer.collect(s), tdev)
            u, _ = timed(lambda b=batch, s=step: trainer.update(b, s), tdev)
            if step > 0:
                collect_s.append(c)
                update_s.append(u)
        return {
            "device": str(tdev),
            "samples_per_step": trainer.cfg.data.per_rank_samples(trainer.world_size),
            "sde_steps": len(batch.rollout.trajectories[0].step_indices),
            "overrides": overrides,
            "collect_s": statistics.median(collect_s),
            "update_s": statistics.median(update_s),
            "step_s": statistics.median([c + u for c, u in zip(collect_s, update_s)]),
            "collect_runs_s": collect_s,
            "update_runs_s": update_s,
            "peak_memory_mib": peak_memory_mib(tdev),
            "background_cores": load.cores() if load is not None else None,
        }


# ---------------------------------------------------------------------------------------------------------
# 4. Recipes: batched CFG, Flow-GRPO-Fast window


def bench_batched_cfg(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    inputs = denoising_inputs(args, device, dtype)
    cond = inputs[2]

    def rollout(batched: bool, noise_level: float = NOISE_LEVEL):
        window = (0, args.steps - 1)
        return seeded_rollout(
            args, inputs, device, noise_level=noise_level, sde_window=window, batched_cfg=batched
        )

    with torch.no_grad():
        diff = (rollout(True, 0.0).final_latents - rollout(False, 0.0).final_latents).abs().max().item()
        seq_times, batched_times = [], []
        load = BackgroundLoad()
        for _ in range(args.repeats):
            seq_times.append(timed(lambda: rollout(False), device)[0])
            batched_times.append(timed(lambda: rollout(True), device)[0])
    return {
        "glyph_lengths": [cond.prompt_embeds.shape[1], cond.negative_embeds.shape[1]],
        "sequential_s": statistics.median(seq_times),
        "batched_s": statistics.median(batched_times),
        "batched_over_sequential": statistics.median(batched_times) / statistics.median(seq_times),
        "sequential_runs_s": seq_times,
        "batched_runs_s": batched_times,
        "max_abs_diff_final_latents_noise0": diff,
        "background_cores": load.cores(),
    }


def bench_fast_window(args: argparse.Namespace, device: torch.device) -> dict:
    from glm_training.engine.trainer import DiTTrainer

    fast = [f"sampling.sde_window_size={args.window}", f"sampling.sde_window_range=[0,{args.steps // 2}]"]
    with tempfile.TemporaryDirectory(prefix="bench_dit_") as tmp:
        trainers = {
            "full_sde": DiTTrainer(load_config(trainer_overrides(args, f"{tmp}/full"), "t2i_training")),
            "fast_window": DiTTrainer(
                load_config([*trainer_overrides(args, f"{tmp}/fast"), *fast], "t2i_training")
            ),
        }
        times = {name: {"collect": [], "update": [], "train_steps": 0} for name in trainers}
        load = None
        for step in range(args.train_steps + 1):  # step 0 warms both up
            if step == 1:
                load = BackgroundLoad()
            for name, trainer in trainers.items():  # alternately, so drifting load hits both alike
                c, batch = timed(lambda t=trainer, s=step: t.collect(s), trainer.policy.device)
                u, stats = timed(lambda t=trainer, b=batch, s=step: t.update(b, s), trainer.policy.device)
                times[name]["train_steps"] = int(stats["num_train_steps"])
                if step > 0:
                    times[name]["collect"].append(c)
                    times[name]["update"].append(u)
    out = {"fast_overrides": fast, "background_cores": load.cores() if load is not None else None}
    for name, t in times.items():
        out[name] = {
            "collect_s": statistics.median(t["collect"]),
            "update_s": statistics.median(t["update"]),
            "step_s": statistics.median([c + u for c, u in zip(t["collect"], t["update"])]),
            "trained_sde_steps": t["train_steps"],
            "collect_runs_s": t["collect"],
            "update_runs_s": t["update"],
        }
    for key in ("collect_s", "update_s", "step_s"):
        out[f"fast_over_full_{key}"] = out["fast_window"][key] / out["full_sde"][key]
    return out


def print_recipes(cfg_result: dict, window: dict) -> None:
    print("\n== batched vs sequential CFG (rollout, full SDE) ==")
    print(f"  glyph lengths (prompt, empty prompt): {cfg_result['glyph_lengths']}")
    print(f"  sequential (s, median)  {cfg_result['sequential_s']:.4f}")
    print(f"  batched (s, median)     {cfg_result['batched_s']:.4f}")
    print(f"  batched / sequential    {cfg_result['batched_over_sequential']:.3f}")
    print(f"  max |diff| final latents, noise 0: {cfg_result['max_abs_diff_final_latents_noise0']:.2e}")
    print("\n== Flow-GRPO-Fast window vs full SDE (trainer, median s) ==")
    for name in ("full_sde", "fast_window"):
        r = window[name]
        print(
            f"  {name:12s} collect {r['collect_s']:.3f}  update {r['update_s']:.3f}  step {r['step_s']:.3f}"
            f"  (trained SDE steps {r['trained_sde_steps']})"
        )
    print(
        f"  fast / full: collect {window['fast_over_full_collect_s']:.3f}  "
        f"update {window['fast_over_full_update_s']:.3f}  step {window['fast_over_full_step_s']:.3f}"
    )
    loads = [x for x in (cfg_result["background_cores"], window["background_cores"]) if x is not None]
    if loads:
        print(f"other processes' CPU use while timing: {' / '.join(f'{x:.2f}' for x in loads)} cores")


# ---------------------------------------------------------------------------------------------------------


def print_report(info: dict, args: argparse.Namespace, den: dict, train: dict | None, mem: str) -> None:
    print("\n== machine ==")
    for key, value in info.items():
        print(f"  {key:15s} {value}")
    print(
        f"\n== setting == model={args.model} {args.height}x{args.width} steps={args.steps} "
        f"batch={args.batch} guidance={args.guidance} dtype={args.dtype} repeats={args.repeats} "
        f"noise_level={NOISE_LEVEL}"
    )
    rows = [
        ("pipeline denoising (s, median)", f"{den['pipeline_s']:.4f}"),
        ("rollout sample_trajectory (s, median)", f"{den['rollout_s']:.4f}"),
        (
            f"rollout / pipeline (target <= {TARGET_RATIO:.2f})",
            f"{den['ratio']:.3f}  {'OK' if den['ratio'] <= TARGET_RATIO else 'OVER'}",
        ),
        ("rollout / pipeline, fastest runs (min / min)", f"{den['ratio_of_mins']:.3f}"),
        (
            "parity max|rollout(noise 0) - pipeline|",
            f"{den['parity_max_abs_diff_noise0']:.2e}  {'OK' if den['parity_ok'] else 'MISMATCH'}",
        ),
        ("peak memory after denoising (MiB)", f"{den['peak_memory_mib']:.1f}"),
    ]
    if train is not None:
        rows += [
            (f"trainer collect (s, median of {args.train_steps})", f"{train['collect_s']:.3f}"),
            (f"trainer update (s, median of {args.train_steps})", f"{train['update_s']:.3f}"),
            ("trainer step = collect + update (s)", f"{train['step_s']:.3f}"),
            ("trainer device / samples per step", f"{train['device']} / {train['samples_per_step']}"),
            ("peak memory after trainer (MiB)", f"{train['peak_memory_mib']:.1f}"),
        ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':{width}s}  value")
    print(f"{'-' * width}  {'-' * 12}")
    for name, value in rows:
        print(f"{name:{width}s}  {value}")
    print(f"\nmemory: {mem}")
    print(f"pipeline runs (s): {' '.join(f'{t:.4f}' for t in den['pipeline_runs_s'])}")
    print(f"rollout runs (s):  {' '.join(f'{t:.4f}' for t in den['rollout_runs_s'])}")
    loads = [den["background_cores"]] + ([train["background_cores"]] if train is not None else [])
    loads = [x for x in loads if x is not None]
    if loads:
        print(f"other processes' CPU use while timing: {' / '.join(f'{x:.2f}' for x in loads)} cores")
        if max(loads) > BUSY_CORES:
            print("WARNING: the machine was busy while timing; these figures are not comparable. Rerun idle.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    info = machine_info(device)

    if args.repeats < 1 or args.train_steps < 1:
        raise SystemExit("--repeats and --train-steps must be >= 1")
    if args.recipes:
        cfg_result = bench_batched_cfg(args, device, DTYPES[args.dtype])
        gc.collect()
        window = bench_fast_window(args, device)
        print("\n== machine ==")
        for key, value in info.items():
            print(f"  {key:15s} {value}")
        print_recipes(cfg_result, window)
        if args.json is not None:
            result = {"machine": info, "setting": {k: str(v) for k, v in vars(args).items()}}
            result.update(batched_cfg=cfg_result, fast_window=window)
            args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
            print(f"wrote {args.json}")
        return 0
    den = bench_denoising(args, device, DTYPES[args.dtype])
    gc.collect()  # the pipeline of phase 1 is released before the trainer loads its own copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    train = None if args.skip_trainer else bench_trainer(args, device)
    mem = memory_label(device)
    print_report(info, args, den, train, mem)
    if args.json is not None:
        result = {
            "machine": info,
            "setting": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "noise_level": NOISE_LEVEL,
            "denoising": den,
            "trainer": train,
            "memory_kind": mem,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

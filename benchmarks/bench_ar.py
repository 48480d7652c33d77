"""Benchmark of the GRPO/DAPO AR rollout and teacher-forced log-probs (issue 4). A script to run, not a test.

    HF_HUB_OFFLINE=1 python benchmarks/bench_ar.py                        # tiny model, 256x256, CPU or CUDA
    python benchmarks/bench_ar.py --height 64 --width 64 --json out.json
    python benchmarks/bench_ar.py --model zai-org/GLM-Image --device cuda --dtype bfloat16 \
        --height 1024 --width 1024 --batch 2 --top-k 50

Measures, on one model with the same prompts, resolution, batch and sampling settings:

1. Rollout: `sample_image_tokens` (its own logits processor, `output_scores`, the position-recording
   hook, per-token log-probs) against a bare `vision_language_encoder.generate(**inputs,
   max_new_tokens=..., do_sample=True, temperature=..., top_p=..., top_k=...)` on the same processor
   inputs, built as `sample_image_tokens` builds them. Generated tokens per second of both and the time
   ratio (target <= 1.10x). Warm-up once, then `--repeats` runs of each, alternated; medians.
2. Teacher-forced log-probs: `teacher_forced_log_probs` under `no_grad`, and with gradients + backward,
   against one plain forward of the model over the same full sequences (`model(input_ids=...,
   attention_mask=..., position_ids=..., image_grid_thw=..., use_cache=False, **extra)`), and a plain
   forward + backward (of the mean logit) for the gradient variant.
3. Peak memory: `torch.cuda.max_memory_allocated` per phase on CUDA; on CPU the process's peak RSS
   (`ru_maxrss`), which only grows, so each figure is the peak up to the end of that phase.
4. Generation speed (issue 14): `sample_image_tokens` with the default dynamic KV cache, with
   `static_cache=True`, and with `static_cache=True, compile=True` (torch.compile of the decoding step);
   generated tokens/s and the ratio to the default, after a warm-up that includes compilation (its time is
   reported apart), runs alternated; and whether each mode sampled the same tokens as the default (the
   same seed) and how far its recorded log-probs are from the default's.

    python benchmarks/bench_ar.py --sections generation --height 256 --width 256 --batch 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dit import (  # noqa: E402  (also puts the repository root on sys.path)
    BUSY_CORES,
    DTYPES,
    TARGET_RATIO,
    BackgroundLoad,
    machine_info,
    memory_label,
    peak_memory_mib,
    prompts_for,
    reset_peak,
    timed,
)

from glm_training.models.wrapper import resolve_model_path  # noqa: E402
from glm_training.rollout.ar import (  # noqa: E402
    SamplingParams,
    chat_inputs,
    sample_image_tokens,
    teacher_forced_log_probs,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny', a local pipeline folder or a hub id")
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per generate() / forward")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 switches top-p off")
    p.add_argument("--top-k", type=int, default=0, help="0 switches top-k off")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--sections",
        default="rollout,teacher_forced,generation",
        help="comma-separated: rollout (1), teacher_forced (2, needs rollout), generation (4)",
    )
    return p.parse_args(argv)


def load_pipeline(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from diffusers import GlmImagePipeline

    pipe = GlmImagePipeline.from_pretrained(resolve_model_path(args.model), torch_dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.vision_language_encoder.eval()
    return pipe


def processor_inputs(pipe, prompts: list[str], height: int, width: int) -> tuple[dict, int]:
    """The inputs `sample_image_tokens` gives generate(), and its max_new_tokens (all grids + 1)."""
    inputs = chat_inputs(pipe, prompts, height, width)
    num_grids = inputs["image_grid_thw"].shape[0] // len(prompts)
    grid_tokens = sum(int(h * w) for _, h, w in inputs["image_grid_thw"][:num_grids].tolist())
    return dict(inputs), grid_tokens + 1


# ---------------------------------------------------------------------------------------------------------
# 1. Rollout vs bare generate()


def bench_rollout(args, pipe, params: SamplingParams, device: torch.device) -> tuple[dict, object]:
    model = pipe.vision_language_encoder
    prompts = prompts_for(args.batch)
    inputs, max_new_tokens = processor_inputs(pipe, prompts, args.height, args.width)
    dev_inputs = {key: value.to(device) for key, value in inputs.items()}
    new_tokens = args.batch * max_new_tokens

    def run_generate():
        torch.manual_seed(args.seed)
        with torch.no_grad():
            return model.generate(
                **dev_inputs,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
            )

    def run_rollout():
        return sample_image_tokens(pipe, prompts, args.height, args.width, params, seed=args.seed)

    reset_peak(device)
    out = run_generate()  # warm-up
    if out.shape[1] != inputs["input_ids"].shape[1] + max_new_tokens:
        raise RuntimeError(f"bare generate() stopped early: {tuple(out.shape)}")
    samples = run_rollout()  # warm-up
    gen_times, roll_times = [], []
    load = BackgroundLoad()
    for _ in range(args.repeats):  # interleaved, so that drifting machine load hits both alike
        gen_times.append(timed(run_generate, device)[0])
        roll_times.append(timed(run_rollout, device)[0])
    gen_s, roll_s = statistics.median(gen_times), statistics.median(roll_times)
    result = {
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "max_new_tokens": max_new_tokens,
        "generated_tokens": new_tokens,
        "generate_s": gen_s,
        "rollout_s": roll_s,
        "generate_tok_per_s": new_tokens / gen_s,
        "rollout_tok_per_s": new_tokens / roll_s,
        "ratio": roll_s / gen_s,
        "ratio_of_mins": min(roll_times) / min(gen_times),
        "target_ratio": TARGET_RATIO,
        "generate_runs_s": gen_times,
        "rollout_runs_s": roll_times,
        "peak_memory_mib": peak_memory_mib(device),
        "background_cores": load.cores(),
        "ar_params": sum(p.numel() for p in model.parameters()),
    }
    return result, samples


# ---------------------------------------------------------------------------------------------------------
# 2. Teacher-forced log-probs vs a plain forward


def bench_teacher_forced(args, pipe, params: SamplingParams, samples, device: torch.device) -> dict:
    model = pipe.vision_language_encoder

    def plain_forward():
        return model(
            input_ids=samples.input_ids.to(device),
            attention_mask=samples.attention_mask.to(device),
            position_ids=samples.position_ids.to(device),
            image_grid_thw=samples.image_grid_thw.to(device),
            use_cache=False,
            **{key: value.to(device) for key, value in samples.extra.items()},
        ).logits

    def plain_forward_no_grad():
        with torch.no_grad():
            return plain_forward()

    def plain_forward_backward():
        model.zero_grad(set_to_none=True)
        plain_forward().float().mean().backward()

    def tf_no_grad():
        with torch.no_grad():
            return teacher_forced_log_probs(model, samples, params)

    def tf_backward():
        model.zero_grad(set_to_none=True)
        teacher_forced_log_probs(model, samples, params).sum().backward()

    variants = {
        "plain_forward_no_grad": plain_forward_no_grad,
        "tf_no_grad": tf_no_grad,
        "plain_forward_backward": plain_forward_backward,
        "tf_backward": tf_backward,
    }
    reset_peak(device)
    for fn in variants.values():  # warm-up
        fn()
    runs: dict[str, list[float]] = {name: [] for name in variants}
    load = BackgroundLoad()
    for _ in range(args.repeats):
        for name, fn in variants.items():
            runs[name].append(timed(fn, device)[0])
    model.zero_grad(set_to_none=True)
    med = {name: statistics.median(times) for name, times in runs.items()}
    return {
        "sequence_length": int(samples.input_ids.shape[1]),
        "scored_tokens_per_sequence": int(samples.completion_mask[0].sum()),
        **{f"{name}_s": value for name, value in med.items()},
        "tf_no_grad_ratio": med["tf_no_grad"] / med["plain_forward_no_grad"],
        "tf_backward_over_forward": med["tf_backward"] / med["plain_forward_no_grad"],
        "tf_backward_over_plain_backward": med["tf_backward"] / med["plain_forward_backward"],
        "runs_s": runs,
        "peak_memory_mib": peak_memory_mib(device),
        "background_cores": load.cores(),
    }


# ---------------------------------------------------------------------------------------------------------
# 4. Generation speed: static KV cache, torch.compile of the decoding step

GENERATION_MODES = {
    "default": {},
    "static_cache": {"static_cache": True},
    "static_cache+compile": {"static_cache": True, "compile": True},
}


def bench_generation_modes(args, pipe, params: SamplingParams, device: torch.device) -> dict:
    prompts = prompts_for(args.batch)

    def runner(kwargs):
        return lambda: sample_image_tokens(
            pipe, prompts, args.height, args.width, params, args.seed, **kwargs
        )

    runners = {name: runner(kwargs) for name, kwargs in GENERATION_MODES.items()}
    warmup_s, outputs = {}, {}
    for name, fn in runners.items():  # warm-up; the compiled mode compiles here
        warmup_s[name], outputs[name] = timed(fn, device)
    reference = outputs["default"]
    mask = reference.completion_mask
    runs: dict[str, list[float]] = {name: [] for name in runners}
    load = BackgroundLoad()
    for _ in range(args.repeats):
        for name, fn in runners.items():
            runs[name].append(timed(fn, device)[0])
    new_tokens = int(mask.sum()) + reference.input_ids.shape[0]  # grids + the extra token per sequence
    med = {name: statistics.median(times) for name, times in runs.items()}
    return {
        "generated_tokens": new_tokens,
        "modes": {
            name: {
                "median_s": med[name],
                "tok_per_s": new_tokens / med[name],
                "speedup_vs_default": med["default"] / med[name],
                "warmup_s": warmup_s[name],
                "same_tokens": bool(torch.equal(outputs[name].input_ids, reference.input_ids)),
                "max_logp_diff": float(
                    (outputs[name].sampling_log_probs - reference.sampling_log_probs)[mask].abs().max()
                ),
                "runs_s": runs[name],
            }
            for name in runners
        },
        "background_cores": load.cores(),
    }


def print_generation_report(gen: dict) -> None:
    print(f"\n== generation speed == {gen['generated_tokens']} generated tokens per call")
    print(
        f"{'mode':22s} {'median s':>9s} {'tok/s':>8s} {'x default':>9s} {'warm-up s':>9s}  "
        "same tokens  max |dlogp|"
    )
    for name, m in gen["modes"].items():
        print(
            f"{name:22s} {m['median_s']:9.4f} {m['tok_per_s']:8.0f} {m['speedup_vs_default']:9.3f} "
            f"{m['warmup_s']:9.2f}  {str(m['same_tokens']):11s}  {m['max_logp_diff']:.2e}"
        )
    if gen["background_cores"] is not None:
        print(f"other processes' CPU use while timing: {gen['background_cores']:.2f} cores")
        if gen["background_cores"] > BUSY_CORES:
            print("WARNING: the machine was busy while timing; these figures are not comparable. Rerun idle.")


def print_report(info: dict, args: argparse.Namespace, roll: dict, tf: dict, mem: str) -> None:
    print("\n== machine ==")
    for key, value in info.items():
        print(f"  {key:15s} {value}")
    print(
        f"\n== setting == model={args.model} {args.height}x{args.width} batch={args.batch} "
        f"temperature={args.temperature} top_p={args.top_p} top_k={args.top_k} dtype={args.dtype} "
        f"repeats={args.repeats}; prompt {roll['prompt_tokens']} tokens, {roll['max_new_tokens']} new "
        f"tokens per sequence, AR params {roll['ar_params']}"
    )
    rows = [
        ("bare generate() (s, median)", f"{roll['generate_s']:.4f}"),
        ("rollout sample_image_tokens (s, median)", f"{roll['rollout_s']:.4f}"),
        ("bare generate() (generated tokens/s)", f"{roll['generate_tok_per_s']:.0f}"),
        ("rollout (generated tokens/s)", f"{roll['rollout_tok_per_s']:.0f}"),
        (
            f"rollout / generate (target <= {TARGET_RATIO:.2f})",
            f"{roll['ratio']:.3f}  {'OK' if roll['ratio'] <= TARGET_RATIO else 'OVER'}",
        ),
        ("rollout / generate, fastest runs (min / min)", f"{roll['ratio_of_mins']:.3f}"),
        ("peak memory after rollout (MiB)", f"{roll['peak_memory_mib']:.1f}"),
        (f"plain forward, no_grad, L={tf['sequence_length']} (s)", f"{tf['plain_forward_no_grad_s']:.4f}"),
        ("teacher_forced_log_probs, no_grad (s)", f"{tf['tf_no_grad_s']:.4f}"),
        ("  / plain forward", f"{tf['tf_no_grad_ratio']:.3f}"),
        ("plain forward + backward (s)", f"{tf['plain_forward_backward_s']:.4f}"),
        ("teacher_forced_log_probs + backward (s)", f"{tf['tf_backward_s']:.4f}"),
        ("  / plain forward (no_grad)", f"{tf['tf_backward_over_forward']:.3f}"),
        ("  / plain forward + backward", f"{tf['tf_backward_over_plain_backward']:.3f}"),
        ("peak memory after log-prob passes (MiB)", f"{tf['peak_memory_mib']:.1f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measure':{width}s}  value")
    print(f"{'-' * width}  {'-' * 12}")
    for name, value in rows:
        print(f"{name:{width}s}  {value}")
    print(f"\nmemory: {mem}")
    print(f"generate runs (s): {' '.join(f'{t:.4f}' for t in roll['generate_runs_s'])}")
    print(f"rollout runs (s):  {' '.join(f'{t:.4f}' for t in roll['rollout_runs_s'])}")
    loads = [x for x in (roll["background_cores"], tf["background_cores"]) if x is not None]
    if loads:
        print(f"other processes' CPU use while timing: {' / '.join(f'{x:.2f}' for x in loads)} cores")
        if max(loads) > BUSY_CORES:
            print("WARNING: the machine was busy while timing; these figures are not comparable. Rerun idle.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    info = machine_info(device)

    pipe = load_pipeline(args, device, DTYPES[args.dtype])
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        codebook_size=int(pipe.transformer.config.prior_vq_quantizer_codebook_size),
    )
    sections = set(args.sections.split(","))
    unknown = sections - {"rollout", "teacher_forced", "generation"}
    if unknown or ("teacher_forced" in sections and "rollout" not in sections):
        raise SystemExit(f"--sections: unknown {sorted(unknown)} or teacher_forced without rollout")
    result = {
        "machine": info,
        "setting": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sampling_params": vars(params),
        "memory_kind": memory_label(device),
    }
    if "rollout" in sections:
        result["rollout"], samples = bench_rollout(args, pipe, params, device)
        result["teacher_forced"] = bench_teacher_forced(args, pipe, params, samples, device)
        print_report(info, args, result["rollout"], result["teacher_forced"], result["memory_kind"])
    if "generation" in sections:
        result["generation"] = bench_generation_modes(args, pipe, params, device)
        if "rollout" not in sections:
            print("\n== machine ==")
            for key, value in info.items():
                print(f"  {key:15s} {value}")
        print_generation_report(result["generation"])
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

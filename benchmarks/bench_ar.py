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
4. Decoding paths (issues 14, 26): `sample_image_tokens` through transformers' generate() (with and
   without its static KV cache) and through the project's decoding loop (eager, and with `--compile` its
   compiled step), next to the bare model (the same prefill and decoding forwards with a preallocated cache,
   no sampling): time per decoding step, tokens/s, and each path's overhead per step (its time minus the
   bare model's) and that overhead as a fraction of generate()'s; for each of `--batches`, all paths
   interleaved in `--repeats` rounds after a warm-up (which compiles; its time is reported apart); whether
   each path drew generate()'s tokens for the seed and how far its recorded log-probs are.

    python benchmarks/bench_ar.py --sections decoding --height 256 --width 256 --batches 1,8,32
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

from glm_training.algorithms.grpo.log_probs import teacher_forced_log_probs
from glm_training.models.wrapper import resolve_model_path  # noqa: E402
from glm_training.pipeline.ar import chat_inputs, sample_image_tokens
from glm_training.pipeline.ar_logits import SamplingParams


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
        default="rollout,teacher_forced,decoding",
        help="comma-separated: rollout (1), teacher_forced (2, needs rollout), decoding (4)",
    )
    p.add_argument(
        "--batches",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[1, 8, 32],
        help="batch sizes of the decoding section",
    )
    p.add_argument("--compile", action="store_true", help="decoding section: also the compiled loop")
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
# 4. Decoding paths: the project's loop against generate(), per token, at several batch sizes

DECODING_MODES = {
    "generate": {"decoding": "generate"},
    "generate+static_cache": {"decoding": "generate", "static_cache": True},
    "loop": {"decoding": "loop"},
    "loop+compile": {"decoding": "loop", "compile": True},
}


def bare_decoding(pipe, samples, device: torch.device):
    """A function replaying `samples`' tokens through the model alone: the prefill, then one forward per
    decoding step with a preallocated KV cache, no sampling, nothing recorded. The reference each path's
    overhead is measured against (what every path must compute)."""
    from transformers import StaticCache

    model = pipe.vision_language_encoder
    ids = samples.input_ids.to(device)
    mask = samples.attention_mask.to(device)
    positions = samples.position_ids.to(device)
    extra = {key: value.to(device) for key, value in samples.extra.items()}
    grids = samples.image_grid_thw.to(device)
    prompt_len = int(samples.completion_mask.long().argmax(dim=1)[0])
    length = ids.shape[1]

    @torch.no_grad()
    def run():
        cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
        model(
            input_ids=ids[:, :prompt_len],
            attention_mask=mask[:, :prompt_len],
            position_ids=positions[:, :, :prompt_len],
            image_grid_thw=grids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        cache_position = torch.zeros(1, dtype=torch.long, device=device)
        for column in range(prompt_len, length - 1):
            cache_position.fill_(column)
            model(
                input_ids=ids[:, column : column + 1],
                attention_mask=mask,
                position_ids=positions[:, :, column : column + 1],
                past_key_values=cache,
                use_cache=True,
                cache_position=cache_position,
            )

    return run


def bench_decoding_paths(args, pipe, params: SamplingParams, device: torch.device) -> dict:
    """Per-token time of every decoding path and of the bare model, for each batch size, interleaved."""
    modes = {name: kw for name, kw in DECODING_MODES.items() if args.compile or not kw.get("compile")}
    results = {}
    for batch in args.batches:
        prompts = prompts_for(batch)

        def runner(kwargs, prompts=prompts):
            return lambda: sample_image_tokens(
                pipe, prompts, args.height, args.width, params, args.seed, **kwargs
            )

        runners = {name: runner(kwargs) for name, kwargs in modes.items()}
        warmup_s, outputs = {}, {}
        for name, fn in runners.items():  # warm-up; the compiled mode compiles here
            warmup_s[name], outputs[name] = timed(fn, device)
        reference = outputs["generate"]
        runners["bare model"] = bare_decoding(pipe, reference, device)
        warmup_s["bare model"] = timed(runners["bare model"], device)[0]
        runs: dict[str, list[float]] = {name: [] for name in runners}
        load = BackgroundLoad()
        for _ in range(args.repeats):  # interleaved: drifting load hits every path alike
            for name, fn in runners.items():
                runs[name].append(timed(fn, device)[0])
        steps = reference.input_ids.shape[1] - int(reference.completion_mask.long().argmax(dim=1)[0])
        med = {name: statistics.median(times) for name, times in runs.items()}
        bare_ms = med["bare model"] / steps * 1e3
        mask = reference.completion_mask
        rows = {}
        for name in runners:
            step_ms = med[name] / steps * 1e3
            row = {
                "median_s": med[name],
                "ms_per_step": step_ms,
                "tok_per_s": batch * steps / med[name],
                "overhead_ms_per_step": step_ms - bare_ms,
                "warmup_s": warmup_s[name],
                "runs_s": runs[name],
            }
            if name in outputs:
                row["same_tokens"] = bool(torch.equal(outputs[name].input_ids, reference.input_ids))
                diff = (outputs[name].sampling_log_probs - reference.sampling_log_probs)[mask]
                row["max_logp_diff"] = float(diff.abs().max())
            rows[name] = row
        gen_overhead = rows["generate"]["overhead_ms_per_step"]
        for row in rows.values():
            row["overhead_vs_generate"] = (
                row["overhead_ms_per_step"] / gen_overhead if gen_overhead > 0 else None
            )
        results[str(batch)] = {"steps": steps, "paths": rows, "background_cores": load.cores()}
    return results


def print_decoding_report(dec: dict) -> None:
    print("\n== decoding paths == per decoding step (one token for each sequence of the batch)")
    print(
        f"{'batch':>5s} {'path':22s} {'ms/step':>8s} {'tok/s':>8s} {'overhead ms':>11s} {'x generate':>10s} "
        f"{'warm-up s':>9s}  same tokens  max |dlogp|"
    )
    for batch, result in dec.items():
        for name, m in result["paths"].items():
            ratio = m["overhead_vs_generate"]
            print(
                f"{batch:>5s} {name:22s} {m['ms_per_step']:8.3f} {m['tok_per_s']:8.0f} "
                f"{m['overhead_ms_per_step']:11.3f} {'-' if ratio is None else f'{ratio:.2f}':>10s} "
                f"{m['warmup_s']:9.2f}  {str(m.get('same_tokens', '-')):11s}  "
                f"{m['max_logp_diff'] if 'max_logp_diff' in m else float('nan'):.2e}"
            )
        cores = result["background_cores"]
        if cores is not None and cores > BUSY_CORES:
            print(f"WARNING: {cores:.2f} cores of other load while timing batch {batch}; rerun idle.")


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
    unknown = sections - {"rollout", "teacher_forced", "decoding"}
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
    if "decoding" in sections:
        result["decoding"] = bench_decoding_paths(args, pipe, params, device)
        if "rollout" not in sections:
            print("\n== machine ==")
            for key, value in info.items():
                print(f"  {key:15s} {value}")
        print_decoding_report(result["decoding"])
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the entry points print for Hydra's flags: `--help` (groups and every key with its doc) and `--cfg`.

The key docs are the comments written beside the config dataclasses' fields in `config.py` (the comment block
above a field and the comment after it), read from the source with `tokenize`/`ast`, so the help cannot drift
from the code. Section headers are the dataclasses' docstrings.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import textwrap
import tokenize
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import OmegaConf

from glm_training.config import CFG_CHOICES, CONFIG_DIR, HYDRA_KEYS, CommandLine, available_configs

# Docs of the fields that carry no comment in config.py, by class and field. A comment beside the field takes
# precedence; tests/test_cli_flags.py checks that every key of both schemas has a doc from one or the other.
MORE_DOCS: dict[str, dict[str, str]] = {
    "DiTTrainConfig": {
        "run_name": "names the default output folder outputs/<run_name>-<time> and the tracker run",
        "component": "the half of GLM-Image that trains: dit here (train_ar.py trains ar)",
    },
    "NFTTrainConfig": {
        "run_name": "names the default output folder outputs/<run_name>-<time> and the tracker run",
        "component": "the half of GLM-Image that trains: dit here (train_ar.py trains ar)",
    },
    "NFTConfig": {
        "name": "the DiT algorithm: nft here (configs/t2i_training.yaml trains flow_grpo)",
        "timestep_fraction": "the update noises each clean latent at int(sampling.num_steps * this) times",
        "num_inner_epochs": "passes over each rollout's samples",
        "ema_decay": "decay of the evaluation EMA (algo.ema)",
    },
    "ARTrainConfig": {
        "run_name": "names the default output folder outputs/<run_name>-<time> and the tracker run",
        "component": "the half of GLM-Image that trains: ar here (train_dit.py trains dit)",
    },
    "ModelConfig": {
        "tiny_seed": "seed of the tiny model's random weights (model.name=tiny only)",
        "shape_num_ar_layers": "AR decoder layers of the real-width fixture (model=glm_image_shape only)",
        "shape_num_dit_layers": "DiT blocks of the real-width fixture (model=glm_image_shape only)",
        "dtype": "weight dtype of the loaded pipeline: float32 | bfloat16 | float16",
        "max_memory_fraction": "share of each GPU's memory a single-process device map may fill (0.1 to 1)",
        "gradient_checkpointing": "recompute activations in the backward pass (less memory, more time)",
    },
    "LoraConfig": {
        "enabled": "LoRA adapters on the trainable component; false trains every weight (full fine-tuning)",
        "rank": "LoRA rank r",
        "alpha": "LoRA alpha; the adapter output is scaled by alpha / rank",
        "dropout": "dropout on the adapter input (keep 0: the recomputed log-probs must equal the rollout's)",
    },
    "DataConfig": {"num_generations": "samples per prompt (a group); group-relative advantages need >= 2"},
    "RewardConfig": {
        "names": "registered rewards (ocr, pickscore, ...) or your own module:function (README, Rewards)",
        "retry_backoff_s": "seconds before the first retry of a retryable reward; doubled for each next one",
        "on_failure": "after the retries: error (stop every rank) | skip (no update this step, counted)",
    },
    "DiTSamplingConfig": {
        "height": "image height in pixels, a multiple of 32",
        "width": "image width in pixels, a multiple of 32",
        "num_steps": "denoising steps of the rollout",
        "guidance_scale": "classifier-free guidance of the DiT (<= 1 disables it)",
        "noise_level": "SDE noise level (Flow-GRPO's a; 0 = the deterministic ODE sampler)",
        "sde_window_end": "end of the SDE window (exclusive); -1 = through the last step",
        "sde_window_range": "[lo, hi]: where a random or progressive SDE window lies (hi -1 = num_steps - 1)",
        "sde_window_stride": "progressive windows: steps the window moves each time it moves",
        "sde_window_every": "progressive windows: training steps between two moves of the window",
    },
    "ARSamplingConfig": {
        "height": "image height in pixels, a multiple of 32",
        "width": "image width in pixels, a multiple of 32",
        "temperature": "sampling temperature of the image tokens",
        "top_p": "nucleus sampling threshold (1 = off)",
        "dit_num_steps": "denoising steps of the frozen DiT that renders each sample for the reward",
        "dit_guidance_scale": "classifier-free guidance of that DiT",
    },
    "FlowGRPOConfig": {
        "clip_range": "PPO clip range of the ratio; tiny because log-probs are means over latent elements",
        "adv_clip_max": "advantages are clipped to [-adv_clip_max, adv_clip_max]",
        "num_inner_epochs": "passes over each rollout's samples",
        "ema": "keep an exponential moving average of the trained weights (evaluated and exported)",
        "ema_decay": "EMA decay per optimizer step",
    },
    "DAPOConfig": {
        "epsilon_low": "lower clip of the token ratio: 1 - epsilon_low",
        "epsilon_high": "upper clip of the token ratio: 1 + epsilon_high (DAPO's clip-higher)",
        "scale_rewards": "advantage scaling: group | batch | none",
        "adv_clip_max": "advantages are clipped to [-adv_clip_max, adv_clip_max]",
        "num_inner_epochs": "passes over each rollout's samples",
        "num_mini_batches": "optimizer steps per rollout (1 = fully on-policy)",
        "micro_batch_size": "samples per forward/backward pass of the AR model",
        "dynamic_sampling": "DAPO's dynamic sampling: drop groups whose rewards are all equal and resample",
        "max_resample_rounds": "extra sampling rounds per step to replace dropped groups",
    },
    "OptimConfig": {
        "lr": "AdamW learning rate",
        "weight_decay": "AdamW weight decay",
        "betas": "AdamW betas",
        "eps": "AdamW epsilon",
        "max_grad_norm": "gradients are clipped to this global norm",
        "warmup_steps": "linear learning-rate warm-up over this many optimizer steps (0 = none)",
    },
    "TrainerConfig": {
        "num_steps": "training steps (each: rollout, rewards, update)",
        "seed": "seed of the prompts and the sampling noise of every step (resume continues it exactly)",
        "dist_timeout_s": "timeout of the distributed collectives",
        "progress_bar": "show a progress bar on rank 0 (false: one log line per step)",
    },
    "EvalConfig": {
        "every_n_steps": "evaluate before training, every this many steps and at the end (0 = off)",
        "num_inference_steps": "denoising steps (0 = as the training sampling)",
        "guidance_scale": "classifier-free guidance (null = as the training sampling)",
        "height": "image height (0 = as the training sampling)",
        "width": "image width (0 = as the training sampling)",
        "batch_size": "prompts per sampling batch (fixed, so results do not depend on the number of ranks)",
        "num_grid_images": "images in the eval/<step>.png grid",
    },
    "LoggingConfig": {
        "wandb": "log to Weights & Biases too (pip install -e .[wandb])",
        "wandb_project": "W&B project",
        "wandb_entity": "W&B entity (team or user; null = your default)",
        "num_images": "images per logged training grid",
    },
}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its comment in the class source: the comment lines right above it, then the one after."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()  # lines holding anything besides a comment
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    class_node = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        after = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(above + after).strip()
        if text:
            docs[node.target.id] = text
    return {**MORE_DOCS.get(cls.__name__, {}), **docs}


def _summary(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature @dataclass writes when there is no docstring
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return repr(value)


def config_groups(command: CommandLine) -> dict[str, list[str]]:
    """Config groups (sub-folders of the config folders) and their options: {"model": ["glm_image", ...]}."""
    groups: dict[str, set[str]] = {}
    for folder in dict.fromkeys([command.config_dir, CONFIG_DIR]):
        for group in sorted(p for p in folder.iterdir() if p.is_dir()):
            groups.setdefault(group.name, set()).update(f.stem for f in group.glob("*.yaml"))
    return {name: sorted(options) for name, options in sorted(groups.items())}


def _key_lines(node: Any, prefix: str = "") -> list[str]:
    lines: list[str] = []
    docs = field_docs(type(node))
    for f in fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            lines += ["", f"{key}: {_summary(type(value))}".rstrip(": ")]
            lines += _key_lines(value, f"{key}.")
            continue
        lines.append(f"  {key}: {f.type} = {_format_value(value)}")
        if f.name in docs:
            lines += textwrap.wrap(docs[f.name], 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return lines


def help_text(cfg: Any, command: CommandLine, prog: str) -> str:
    """`--help`: usage, Hydra's flags this project honours, config files and groups, then every key.

    `cfg` is the config of this command line (its values are shown beside each key).
    """
    groups = config_groups(command)
    lines = [
        f"{prog}: {_summary(type(cfg))}",
        "",
        f"usage: python {prog} [--config FILE | --config-name NAME] [--cfg {'|'.join(CFG_CHOICES)}] "
        "[--help] [key=value ...]",
        "",
        "flags:",
        "  --config FILE, -c FILE   a YAML config (configs/*.yaml, or your own file extending one)",
        "  --config-name NAME, -cn  a config in configs/ (--config-path DIR, -cp: in another folder)",
        "  --cfg job                print the resolved config (the run's config.yaml), exit; no model loads",
        "  --cfg hydra              print the Hydra settings used (run dir, config sources, overrides)",
        "  --cfg all                both: the hydra: block, then the job config",
        "  --resolve                accepted; what --cfg prints is always resolved",
        "  --help, -h               this text",
        "",
        f"configs: {', '.join(available_configs())} (this one: {command.config_dir / command.config_name}"
        ".yaml)",
        "",
        "config groups (choose with group=option):",
    ]
    for group, options in groups.items():
        current = getattr(getattr(cfg, group, None), "name", None)
        this = f"   (this config: {group}.name={current})" if current else ""
        lines.append(f"  {group}: {' | '.join(options)}{this}")
    lines += [
        "",
        "overrides: key=value for any key below (lists: [a,b]), group=option, +key=value / ~key as in Hydra,",
        *(f"  {h}=DIR sets {k} (Hydra's run directory)" for h, k in HYDRA_KEYS.items()),
        "",
        "keys (type = value in this config, then its doc):",
    ]
    lines += _key_lines(cfg)
    return "\n".join(lines)


def hydra_yaml(cfg: Any, command: CommandLine) -> str:
    """`--cfg hydra`: the part of Hydra's own config a run here uses, as Hydra would print it.

    There is no `@hydra.main` (no launcher, sweeper or job logging to configure): what exists is the run
    directory (`trainer.output_dir`), the job's name and config, and where the config came from.
    """
    output_dir = cfg.trainer.output_dir or f"outputs/{cfg.run_name}-<start time>"
    sources = [str(command.config_dir)] + ([str(CONFIG_DIR)] if command.config_dir != CONFIG_DIR else [])
    block = {
        "hydra": {
            "run": {"dir": output_dir},
            "job": {"name": cfg.run_name, "config_name": command.config_name},
            "runtime": {"config_sources": sources},
            "overrides": {"task": list(command.overrides)},
        }
    }
    return OmegaConf.to_yaml(OmegaConf.create(block))


def print_config_text(cfg: Any, command: CommandLine) -> str:
    """What `--cfg job|hydra|all` prints (job: exactly the config.yaml the run would write)."""
    from glm_training.config import config_to_yaml

    job = config_to_yaml(cfg)
    if command.print_config == "job":
        return job.rstrip("\n")
    if command.print_config == "hydra":
        return hydra_yaml(cfg, command).rstrip("\n")
    return (hydra_yaml(cfg, command) + job).rstrip("\n")


__all__ = ["config_groups", "field_docs", "help_text", "hydra_yaml", "print_config_text"]

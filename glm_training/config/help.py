"""What the entry points print for Hydra's flags: `--help` (groups and every key with its doc) and `--cfg`.

The key docs are the fields' `help` metadata (`option(default, help)`, `config/options.py`, as TRL's
`field(metadata={"help": ...})`), so the help cannot drift from the code. Section headers are the
dataclasses' docstrings.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import OmegaConf

from glm_training.config.loading import (
    CFG_CHOICES,
    HYDRA_KEYS,
    RECIPE_DIR,
    CommandLine,
    available_configs,
    config_to_yaml,
)
from glm_training.config.options import CONFIG_DIR


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its `--help` text: the `help` metadata `option(default, help)` gives each field."""
    return {f.name: f.metadata["help"] for f in fields(cls) if f.metadata.get("help")}


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
    """Config groups (sub-folders of the config folders) and their options: {"model": ["glm_image", ...]}.

    `recipes/` is not a group: its files are whole configs, chosen with --config-name recipes/<name>.
    """
    groups: dict[str, set[str]] = {}
    for folder in dict.fromkeys([command.config_dir, CONFIG_DIR]):
        for group in sorted(p for p in folder.iterdir() if p.is_dir() and p != RECIPE_DIR):
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
            lines += textwrap.wrap(
                docs[f.name], 100, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
            )
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
        "  --config-name NAME, -cn  a config in configs/; recipes/<name>: the real model (docs/recipes.md)",
        "                           (--config-path DIR, -cp: in another folder)",
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
    job = config_to_yaml(cfg)
    if command.print_config == "job":
        return job.rstrip("\n")
    if command.print_config == "hydra":
        return hydra_yaml(cfg, command).rstrip("\n")
    return (hydra_yaml(cfg, command) + job).rstrip("\n")


__all__ = ["config_groups", "field_docs", "help_text", "hydra_yaml", "print_config_text"]

"""From a command line (or Python) to a validated run config: Hydra composition, overrides, saved configs.

Two command-line spellings are accepted by `load_config`:

    python train_dit.py --config configs/t2i_training.yaml algo.beta=0.04
    python train_dit.py --config-name t2i_training algo.beta=0.04  # Hydra's (-cn, --config-path)
    torchrun --nproc_per_node=8 train_dit.py --config-name recipes/flow_grpo_ocr  # a real-model recipe

and Hydra's own flags for one run: `--cfg job|all|hydra` prints the resolved config and exits, `--help` lists
the groups and every key with its doc (`config/help.py`), `hydra.run.dir=DIR` sets `trainer.output_dir`.
Errors name the key and the fix (`ConfigError`), with the closest valid key for a misspelt one.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from glm_training.config.algorithms import ALGORITHMS, algorithm_of, register_configs
from glm_training.config.options import CONFIG_DIR, ConfigError, _check_choice


@dataclass
class CommandLine:
    config_dir: Path
    config_name: str
    overrides: list[str]
    print_config: str | None = None  # --cfg job|all|hydra: print the resolved config and exit
    help: bool = False  # --help: list the flags, config groups and every key with its doc, and exit


# Hydra's flags: the ones a single training run uses work; the others are refused with the reason.
CFG_CHOICES = ("job", "all", "hydra")
_VALUE_FLAGS = ("--config", "-c", "--config-name", "-cn", "--config-path", "-cp", "--cfg")
_REFUSED = {
    ("--multirun", "-m"): "sweeps are not supported; start one run per setting (each its own output_dir)",
    ("--info", "-i"): "use --cfg job to see the resolved config, --help for the groups and keys",
    ("--package", "-p"): "--cfg prints the whole config; read one key in it",
    ("--run", "-r"): "a plain run is the default, drop the flag",
    ("--shell-completion", "-sc"): "shell completion is not installed by this project",
    ("--experimental-rerun",): "continue a run with trainer.resume=latest instead",
}
_REFUSED_FLAGS = {flag: why for flags, why in _REFUSED.items() for flag in flags}
# Real-model runs (`--config-name recipes/<name>`); a recipe in a subfolder starts with `# @package _global_`
# and names the schema and the model group absolutely (`- /dit_schema`, `- /model: glm_image`).
RECIPE_DIR = CONFIG_DIR / "recipes"
# hydra.<key> overrides that mean something here, as the config key they set.
HYDRA_KEYS = {"hydra.run.dir": "trainer.output_dir"}
# Keys that saved configs of every algorithm may hold but no run config has now (dropped when one loads):
# `algo.ema_every_micro_batch`, which `algo.ema_calls` replaced.
RETIRED_KEYS = ("algo.ema_every_micro_batch",)


def parse_command_line(argv: list[str], default_config: str) -> CommandLine:
    """Split argv into the config file, Hydra's flags and overrides; `--config FILE` and `--config-name` work.

    Hydra's own flags: `--cfg job|all|hydra` (with or without `--resolve`) and `--help`/`-h` (and
    `--hydra-help`) are recorded for the entry point to act on; `hydra.run.dir=DIR` becomes
    `trainer.output_dir=DIR`. `-c` stays this project's short form of `--config` (Hydra's `--cfg`).
    """
    config_file: str | None = None
    config_dir: str | None = None
    config_name: str | None = None
    print_config: str | None = None
    want_help = False
    overrides: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, inline = arg.partition("=")
        if flag in _VALUE_FLAGS:
            value = inline if eq else next(it, None)
            if value is None or (not eq and value.startswith("-")):
                example = "--cfg job" if flag == "--cfg" else "--config configs/t2i_training.yaml"
                raise ConfigError(flag, f"expects a value, e.g. {example}")
            if flag in ("--config", "-c"):
                config_file = value
            elif flag in ("--config-name", "-cn"):
                config_name = value
            elif flag == "--cfg":
                _check_choice(value, CFG_CHOICES, "--cfg")
                print_config = value
            else:
                config_dir = value
        elif arg in ("--help", "-h", "--hydra-help"):
            want_help = True
        elif arg == "--resolve":
            pass  # what --cfg prints is always resolved: it is the typed config the run would use
        elif arg.startswith("-"):
            refused = _REFUSED_FLAGS.get(flag)
            if refused:
                raise ConfigError(flag, f"Hydra's flag is not supported here: {refused}.")
            raise ConfigError(
                arg,
                "unknown flag; use --config FILE or --config-name NAME, then key=value overrides "
                "(--cfg job prints the config, --help lists the keys).",
            )
        else:
            overrides.append(arg)
    overrides = _map_hydra_overrides(overrides)

    if config_file is not None:
        path = _config_file(config_file)
        if path is None:
            raise ConfigError("--config", f"no such file '{config_file}'; available: {available_configs()}.")
        if path.is_relative_to(CONFIG_DIR):
            # A shipped config (a recipe too) composes by its name in configs/, as --config-name does.
            name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
            return CommandLine(CONFIG_DIR, name, overrides, print_config, want_help)
        return CommandLine(path.parent, path.stem, overrides, print_config, want_help)
    name = config_name or default_config
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    directory = Path(config_dir).expanduser().resolve() if config_dir else CONFIG_DIR
    if not (directory / f"{name}.yaml").is_file():
        raise ConfigError(
            "--config-name", f"no '{name}.yaml' in {directory}; available: {available_configs()}."
        )
    return CommandLine(directory, name, overrides, print_config, want_help)


def _map_hydra_overrides(overrides: list[str]) -> list[str]:
    """`hydra.run.dir=DIR` -> `trainer.output_dir=DIR`; any other `hydra.` key is refused, never ignored.

    The config is composed with Hydra's compose API, not run under `@hydra.main`: no change of working
    directory, no `.hydra/` folder and no sweep, so the rest of Hydra's own settings would have no effect.
    """
    mapped: list[str] = []
    keys = {o.lstrip("+~").partition("=")[0] for o in overrides}
    for override in overrides:
        key, eq, value = override.lstrip("+").partition("=")
        if not key.startswith("hydra."):
            mapped.append(override)
            continue
        if key not in HYDRA_KEYS or not eq:
            raise ConfigError(
                key,
                "this Hydra setting has no effect here (the config is composed, not run under @hydra.main); "
                f"supported: {', '.join(f'{h}=... (sets {k})' for h, k in HYDRA_KEYS.items())}.",
            )
        target = HYDRA_KEYS[key]
        if target in keys:
            raise ConfigError(key, f"sets {target}, which is also given; keep one of the two.")
        mapped.append(f"{target}={value}")
    return mapped


def _config_file(value: str) -> Path | None:
    """A `--config` value as an existing YAML file: the path itself, else the same path inside `configs/`
    (`--config recipes/flow_grpo_ocr`, and `load_config(config="recipes/...")`, which passes a name with a
    slash as a file)."""
    path = Path(value).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        path = path.with_suffix(".yaml")
    for candidate in (path, CONFIG_DIR / path):
        if candidate.is_file():
            return candidate.resolve()
    return None


def available_configs() -> list[str]:
    """The shipped run configs: tiny quick-starts in `configs/`, real-model recipes in `configs/recipes/`."""
    files = [*CONFIG_DIR.glob("*.yaml"), *RECIPE_DIR.glob("*.yaml")]
    return sorted(str(p.relative_to(CONFIG_DIR.parent)) for p in files)


def compose_config(command: CommandLine) -> Any:
    """Compose the YAML with Hydra (defaults list, config groups, overrides) and convert it to dataclasses."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    register_configs()
    overrides = list(command.overrides)
    if command.config_dir != CONFIG_DIR:
        # A config file elsewhere still resolves the project's groups (model/tiny, model/glm_image).
        overrides.append(f"hydra.searchpath=[file://{CONFIG_DIR}]")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(command.config_dir), version_base=None):
            cfg = compose(config_name=command.config_name, overrides=overrides)
        cfg = _with_schema(cfg, command)
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            key = missing[0]
            hint = " (pick a model: model=tiny or model=glm_image)" if key == "model.name" else ""
            raise ConfigError(
                key, f"is required; set it in the YAML or on the command line ({key}=...){hint}."
            )
        return _to_object(cfg)
    except ConfigError:
        raise
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise _unknown_key_error(err) from None
    except MissingMandatoryValue as err:
        key = _full_key(err)
        raise ConfigError(
            key, f"is required; set it in the YAML or on the command line ({key}=...)."
        ) from None
    except ValidationError as err:
        key = _full_key(err)
        raise ConfigError(key, f"wrong type or value: {err.msg.splitlines()[0]}") from None
    except MissingConfigException as err:
        raise _missing_option_error(err) from None
    except HydraException as err:
        cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            raise _unknown_key_error(cause) from None
        if isinstance(cause, ValidationError):
            key = _full_key(cause)
            raise ConfigError(key, f"wrong type or value: {cause.msg.splitlines()[0]}") from None
        raise ConfigError("overrides", f"{str(err).splitlines()[0]}") from None
    finally:
        GlobalHydra.instance().clear()


def _missing_option_error(err: Any) -> ConfigError:
    """A config group given an option it does not have (`model=tinyy`): the closest option and all of them
    (the schemas Hydra lists beside them are left out: they are no choice)."""
    group, _, name = str(err.missing_cfg_file).rpartition("/")
    options = [o for o in (err.options or []) if not o.endswith("_schema")]
    if not group or not options:
        return ConfigError("overrides", str(err).splitlines()[0])
    close = difflib.get_close_matches(name, options, n=1)
    guess = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(
        group, f"'{name}' is not one of its options; {guess}the options: {', '.join(options)}."
    )


def _with_schema(cfg: Any, command: CommandLine) -> Any:
    """A YAML without a schema in its defaults list (e.g. what `--cfg job` printed, or a run's config.yaml)
    is typed by its `component` and `algo.name` keys, so it validates like any config instead of passing as
    a plain dict."""
    if is_dataclass(OmegaConf.get_type(cfg)):
        return cfg
    folder = command.config_name.partition("/")[0] if "/" in command.config_name else None
    if folder is not None and list(cfg.keys()) == [folder]:
        raise ConfigError(
            "defaults",
            f"{command.config_dir / command.config_name}.yaml sits in the subfolder {folder}/, so Hydra "
            f"nests it under '{folder}:'; start the file with `# @package _global_` and name the schema and "
            "the model absolutely (`- /dit_schema`, `- /model: glm_image`), as configs/recipes/*.yaml do.",
        )
    if cfg.get("component") is None:
        raise ConfigError(
            "defaults",
            f"{command.config_dir / command.config_name}.yaml names no schema; start it with "
            "`defaults: [dit_schema, {model: tiny}, _self_]` (ar_schema for the AR trainer) or set "
            "`component: dit` / `component: ar`.",
        )
    return OmegaConf.merge(OmegaConf.structured(_schema_of(cfg)), cfg)


def _to_object(cfg: Any) -> Any:
    """The typed config; a joint config's errors name its keys as it spells them (`ar.algo.beta`)."""
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError as err:
        if cfg.get("component") != "joint":
            raise
        from glm_training.config.joint import joint_key_error

        raise joint_key_error(cfg, err) from None


def _schema_of(cfg: Any) -> type:
    """The run config dataclass of a config typed by its `component` (and `algo.name`) keys."""
    if cfg.get("component") == "joint":
        from glm_training.config.joint import JointTrainConfig

        return JointTrainConfig
    return algorithm_of(cfg).run_config


def load_config(
    argv: Sequence[str] | None = None,
    default_config: str = "t2i_training",
    *,
    config: str | None = None,
    overrides: Sequence[str] = (),
) -> Any:
    """The validated config dataclass (`DiTTrainConfig` or `ARTrainConfig`) of a command line or of Python.

    Command line: `load_config(sys.argv[1:], "t2i_training")`. Python: `load_config(config="ar_training",
    overrides=["trainer.num_steps=10"])`; `config` is a name in `configs/` (`recipes/flow_grpo_ocr` too) or a
    YAML path, `overrides` Hydra
    overrides (`key=value`, `model=glm_image`, `hydra.run.dir=DIR`). Printing flags (`--cfg`, `--help`) belong
    to the entry points; from Python use `config_to_yaml(cfg)`.
    """
    args = list(argv or [])
    if config is not None:
        is_file = config.endswith((".yaml", ".yml")) or "/" in config
        args = ["--config" if is_file else "--config-name", config, *args]
    command = parse_command_line([*args, *overrides], default_config)
    if command.print_config or command.help:
        flag = "--help" if command.help else "--cfg"
        raise ConfigError(
            flag, "prints and exits in the entry points only; in Python print config_to_yaml(cfg)."
        )
    return compose_config(command)


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """A run's saved `config.yaml` (checkpoints carry one) with `key=value` overrides, as the typed config."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            "config.yaml", f"'{path}' does not exist; a checkpoint folder holds its run's config.yaml."
        )
    saved = OmegaConf.load(path)
    algorithm = algorithm_of(saved)
    for key in (*RETIRED_KEYS, *algorithm.retired_keys):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(saved, parent) if parent else saved
        if node is not None and leaf in node:
            node.pop(leaf)
    schema = algorithm.run_config
    try:
        cfg = OmegaConf.merge(
            OmegaConf.structured(schema), saved, OmegaConf.from_dotlist(list(overrides or []))
        )
        return OmegaConf.to_object(cfg)
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise _unknown_key_error(err) from None
    except ValidationError as err:
        raise ConfigError(_full_key(err), f"wrong type or value: {err.msg.splitlines()[0]}") from None


def _full_key(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    return str(key)


# Settings a TRL / transformers / diffusers user types, and where each one is here (a key this config does not
# have: the names that exist, e.g. `eval.seed`, never reach this table).
FAMILIAR_KEYS = {
    "max_steps": "trainer.num_steps",
    "num_train_epochs": "trainer.num_steps (a step is one rollout and its updates; there are no epochs)",
    "learning_rate": "optim.lr",
    "warmup_steps": "optim.warmup_steps",
    "weight_decay": "optim.weight_decay",
    "max_grad_norm": "optim.max_grad_norm",
    "save_steps": "trainer.save_every",
    "save_total_limit": "trainer.keep_last",
    "eval_steps": "eval.every_n_steps",
    "logging_steps": "none, every step's metrics are logged (metrics.jsonl, TensorBoard); image grids every "
    "logging.images_every_n_steps",
    "report_to": "logging.tensorboard=true / logging.wandb=true",
    "output_dir": "trainer.output_dir",
    "seed": "trainer.seed",
    "bf16": "trainer.mixed_precision=bf16",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "per_device_train_batch_size": "data.num_groups_per_step x data.num_generations samples a step over "
    "all ranks; images per forward: sampling.micro_batch_size (DiT) or algo.micro_batch_size (AR)",
    "gradient_accumulation_steps": "algo.num_mini_batches (the optimizer steps a rollout's samples are "
    "split into; each accumulates its micro-batches)",
    "num_generations": "data.num_generations",
    "beta": "algo.beta",
    "epsilon": "algo.clip_range",
}


def _unknown_key_error(err: OmegaConfBaseException) -> ConfigError:
    full_key = _full_key(err)
    parent, _, leaf = full_key.rpartition(".")
    valid = _valid_keys(parent)
    close = difflib.get_close_matches(leaf, valid, n=1)
    hint = f" Did you mean '{(parent + '.') if parent else ''}{close[0]}'?" if close else ""
    if leaf in FAMILIAR_KEYS:
        hint = f" TRL's / transformers' '{leaf}' here: {FAMILIAR_KEYS[leaf]}."
    return ConfigError(
        full_key, f"no such key.{hint} Valid keys{' under ' + parent if parent else ''}: {valid}."
    )


def _valid_keys(parent: str) -> list[str]:
    """Field names at a dotted path of any run config (union over the algorithms' run configs)."""
    from glm_training.config.joint import JointTrainConfig

    names: set[str] = set()
    for schema in {a.run_config for a in ALGORITHMS.values()} | {JointTrainConfig}:
        node: Any = schema
        for part in [p for p in parent.split(".") if p]:
            match = [f for f in fields(node) if f.name == part] if is_dataclass(node) else []
            node = _field_type(match[0]) if match else None
            if node is None:
                break
        if node is not None and is_dataclass(node):
            names.update(f.name for f in fields(node))
    return sorted(names)


def _field_type(f: Any) -> Any:
    default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
    return type(default) if is_dataclass(default) else None


def config_to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


__all__ = [
    "CFG_CHOICES",
    "HYDRA_KEYS",
    "RECIPE_DIR",
    "CommandLine",
    "available_configs",
    "compose_config",
    "config_to_yaml",
    "load_config",
    "load_run_config",
    "parse_command_line",
]

"""Reward registry: the `Reward` interface and name -> class lookup.

A reward scores a batch of decoded images against their prompts (the reward signal of DDPO /
Flow-GRPO / GRPO). Rewards register themselves under a config name with `@register_reward("name")`;
configs refer to them by that name and `build_reward` constructs one. Name and option typos are
reported before anything heavy (a reward model) is loaded.
"""

from __future__ import annotations

import abc
import difflib
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from PIL import Image

from glm_training.errors import UserError

_REGISTRY: dict[str, type[Reward]] = {}

RewardT = TypeVar("RewardT", bound="type[Reward]")


class RewardWeightsError(UserError, FileNotFoundError):
    """A reward model's weight file is neither a local file nor in the hub cache; the message says how to
    get it."""


class Reward(abc.ABC):
    """A batch reward. Subclasses set nothing by hand: `name` comes from `register_reward`."""

    name: str = "<unregistered>"
    # True for scorers whose failures are transient (a server restarting, a CUDA error): they are retried
    # with back-off (`reward.max_retries`, see `rewards/retry.py`). A failing pure function is a bug.
    retryable: bool = False
    # The approximate parameter count of the model(s) the reward loads, for the memory plan (weights on each
    # rank, counted in float32); 0 for rewards that load none (a pure function, a remote server).
    approx_params: int = 0

    @abc.abstractmethod
    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Score a batch. Returns a float32 CPU tensor `scores_n` of shape [len(images)]."""

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:  # noqa: B027
        """Validate the prompt set once at start-up, before any model is loaded.

        Raise ValueError naming the offending prompt and the fix. The default accepts everything.
        """


def register_reward(name: str) -> Callable[[RewardT], RewardT]:
    """Class decorator registering a `Reward` subclass under `name` (sets `cls.name`)."""

    def decorator(cls: RewardT) -> RewardT:
        if not (isinstance(cls, type) and issubclass(cls, Reward)):
            raise TypeError(f"@register_reward({name!r}) must decorate a Reward subclass, got {cls!r}")
        if name in _REGISTRY:
            existing = _REGISTRY[name]
            raise ValueError(
                f"reward name {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}; pick another name"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def available_rewards() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def unknown_reward_message(name: str) -> str:
    """The error text for an unknown reward name: closest match and the available names."""
    close = difflib.get_close_matches(name, _REGISTRY, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown reward {name!r}.{hint} Available rewards: {', '.join(available_rewards())}"


def reward_class(name: str) -> type[Reward]:
    """The class registered under `name`; ValueError listing the available names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(unknown_reward_message(name))
    return _REGISTRY[name]


def reward_model_params(name: str) -> int:
    """`approx_params` of the reward registered under `name`; 0 for a name not registered (a
    `module:function` reward)."""
    cls = _REGISTRY.get(name)
    return cls.approx_params if cls is not None else 0


def check_reward_options(name: str, options: dict[str, Any]) -> None:
    """Check `name` exists and its constructor accepts `options`, without constructing anything."""
    cls = reward_class(name)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [
        p.name
        for p in params.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward {name!r} got unknown option(s) {unknown}; it accepts {accepted or 'no options'}"
        )


def build_reward(name: str, **options: Any) -> Reward:
    """Construct the reward registered under `name` with `options` as constructor keywords."""
    check_reward_options(name, options)
    return reward_class(name)(**options)


def reward_device(device: str = "auto") -> torch.device:
    """The device a reward model runs on: "auto" is this process's own device (`cuda:LOCAL_RANK` or CPU).

    A bare "cuda" also means the rank's own GPU: rewards are built before the distributed engine sets the
    current device, so "cuda" would otherwise put every rank's reward models on GPU 0.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        from glm_training.distributed.collectives import choose_device

        return choose_device(local_rank)
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"reward device {device!r} is not a device; use 'auto', 'cpu' or 'cuda:N'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"reward device {device!r} asks for CUDA, which is not available; use 'auto' or 'cpu'"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", local_rank % torch.cuda.device_count())
        elif resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"reward device {device!r}: this machine has {torch.cuda.device_count()} GPU(s); "
                "use 'auto' (the rank's own GPU) or an existing index"
            )
    return resolved


REWARD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reward_dtype(dtype: str = "float32") -> torch.dtype:
    """A reward model's weight dtype from its config name."""
    if dtype not in REWARD_DTYPES:
        raise ValueError(f"reward dtype {dtype!r} is not one of {sorted(REWARD_DTYPES)}")
    return REWARD_DTYPES[dtype]


def resolve_weight_file(spec: str, *, what: str, example: str) -> Path:
    """A reward model's weight file: `spec` itself if it is an existing file, else the hub file
    `owner/repo/path/in/repo` fetched with `hf_hub_download` (only from the cache when HF_HUB_OFFLINE=1).

    `what` names the option in errors (e.g. "hpsv2 checkpoint"); `example` is a valid hub form.
    """
    local = Path(spec).expanduser()
    if local.is_file():
        return local
    if local.is_absolute() or spec.startswith((".", "~")):
        raise RewardWeightsError(f"{what} '{spec}' does not exist")
    parts = spec.split("/")
    if len(parts) < 3 or not all(parts):
        raise RewardWeightsError(
            f"{what} {spec!r} is not an existing file, nor of the hub form 'owner/repo/filename' "
            f"(e.g. {example!r}); give a local file path or a hub file"
        )
    from huggingface_hub import hf_hub_download

    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename))
    except Exception as err:  # hub errors have many types (offline, missing entry, network, auth)
        raise RewardWeightsError(
            f"{what} {spec!r} is not a local file and could not be fetched as {filename!r} from the hub "
            f"repo {repo_id!r}: {err}\nFix: download it once with `hf download {repo_id} {filename}` on a "
            "machine with network access (HF_HUB_OFFLINE=1 reads only the cache), or pass a local file path"
        ) from err

"""Reward functions written by users, named in the config as `module:function` or `path/to/file.py:function`.

The contract, checked on every batch by `RewardSet` (and so on the first one):

    def my_reward(images: list[PIL.Image.Image], prompts: list[str], metadata: list[dict], **options)
        -> torch.Tensor | numpy.ndarray | list[float]    # one finite score per image, shape (N,)

`reward.options["module:function"]` are passed as keyword arguments on every call; that they bind to the
function's signature is checked at start-up, before any model is loaded. The target may also be a `Reward`
subclass, which is then constructed with the options (a class needing set-up, e.g. a model to load). In a
config:

    reward:
      names: [jpeg_compressibility, "my_rewards:sharpness"]
      weights: [1.0, 0.5]
      options:
        "my_rewards:sharpness": {radius: 2}

`my_rewards` is imported as a module (from the current directory or anywhere on `sys.path`); a name ending in
`.py` is loaded from that file.

From Python the function itself (or a `Reward` object) can be handed to a trainer, TRL-style:
`DiTTrainer(cfg, reward_funcs=[my_reward])`; `CallableReward.from_object` wraps it and `reward_name` names it
(the name in the metrics, `reward/<name>`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from glm_training.rewards.registry import Reward


def is_callable_target(name: str) -> bool:
    """Whether a reward name refers to user code (`module:function`) rather than the registry."""
    return ":" in name


def load_target(target: str) -> Any:
    """The object `module:attr` or `file.py:attr` names; ValueError naming what is missing and the form."""
    module_name, _, attr = target.rpartition(":")
    form = "give it as 'module:function' or 'path/to/file.py:function'"
    if not module_name or not attr:
        raise ValueError(f"reward {target!r} is not a valid user reward; {form}")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise ValueError(f"reward {target!r}: file '{path}' does not exist; {form}")
        spec = importlib.util.spec_from_file_location(f"glm_training_user_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            # `python train_dit.py` puts the script's folder first on sys.path, not the working directory
            # where users keep their reward modules.
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ValueError(
                f"reward {target!r}: cannot import module {module_name!r} ({err}); run from the folder that "
                f"holds it, add it to PYTHONPATH, or {form}"
            ) from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"reward {target!r}: module {module_name!r} has no {attr!r}; it has {public}")
    return getattr(module, attr)


def reward_name(obj: Any) -> str:
    """The metrics name of a reward given as a Python object (`reward/<name>` in metrics.jsonl).

    A registered `Reward` keeps its registry name; another `Reward` object is named after its class; a
    function after `__name__` (a lambda is "lambda"); a `functools.partial` after the function it wraps; any
    other callable object after its class.
    """
    if isinstance(obj, Reward):
        return obj.name if obj.name != Reward.name else type(obj).__name__
    if isinstance(obj, functools.partial):
        return reward_name(obj.func)
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return "lambda" if name == "<lambda>" else name


class CallableReward(Reward):
    """A user's function (or `Reward` subclass) as a reward; `options` are its keyword arguments."""

    def __init__(self, target: str, **options: Any) -> None:
        self._bind(target, load_target(target), options)

    @classmethod
    def from_object(cls, obj: Reward | Callable[..., Any], name: str) -> CallableReward:
        """A reward object or function given directly in Python (no options: bind them with a closure)."""
        reward = cls.__new__(cls)
        reward._bind(name, obj, {})
        return reward

    def _bind(self, name: str, obj: Any, options: dict[str, Any]) -> None:
        self.name = name
        if isinstance(obj, Reward):
            self.fn: Any = obj
            self.options: dict[str, Any] = {}
            return
        if isinstance(obj, type) and issubclass(obj, Reward):
            self.fn = obj(**options)
            self.options = {}
            return
        if not callable(obj):
            raise ValueError(f"reward {name!r} is a {type(obj).__name__}, not a function or Reward class")
        try:
            inspect.signature(obj).bind([], [], [], **options)
        except TypeError as err:
            raise ValueError(
                f"reward {name!r} cannot be called as fn(images, prompts, metadata, **options) with "
                f"options {sorted(options)}: {err}"
            ) from None
        except ValueError:
            pass  # builtins without a signature: the first batch checks the call
        self.fn = obj
        self.options = options

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        if isinstance(self.fn, Reward):
            self.fn.check_prompts(prompts, metadata)

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        scores = self.fn(images, prompts, metadata, **self.options)
        if isinstance(scores, torch.Tensor):
            return scores
        try:
            return torch.as_tensor(np.asarray(scores, dtype=np.float32))
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"reward {self.name!r} returned {type(scores).__name__}, which is not a sequence of numbers "
                f"({err}); return one float per image (a list, numpy array or torch tensor of shape (N,))"
            ) from None

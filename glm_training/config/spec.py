"""`AlgorithmSpec`: one row of the algorithm table (`config/algorithms.py`), declared in each algorithm's
folder (`algorithms/<name>/__init__.py`). Torch-free: the algorithm class is named as "module:Class" and
imported only when training starts, so `--cfg` and `--help` answer without loading torch."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


def import_named(target: str | type) -> type:
    """A class, or the class a "module:Class" string names (imported now)."""
    if isinstance(target, type):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class AlgorithmSpec:
    """One trainable algorithm: its name, the half it trains, its run config and its algorithm class."""

    name: str  # `algo.name` in its configs
    component: str  # the half of GLM-Image it trains: "dit" | "ar"
    run_config: type  # the run config dataclass (its `algo` section has `name` = this name)
    schema: str  # the run config's name in Hydra's ConfigStore, as YAML defaults lists name it
    # Its algorithm class (`algorithms/base.py`), or "module:Class" (imported when training starts: the
    # shipped ones are named so).
    algorithm: str | type
    config: str  # the shipped config in `configs/` that trains it on the tiny model
    # The extra copies of the trained weights it keeps, by name (the memory plan adds a term for each).
    policy_copies: tuple[str, ...] = ()
    # Keys that saved run configs of it may hold but it never read (dropped when a saved config loads).
    retired_keys: tuple[str, ...] = ()
    # Other names users know it by, which are its settings here (GRPO's DAPO and GSPO): `algo.name=<one>` is
    # answered with this algorithm's config.
    variants: tuple[str, ...] = ()

    def algorithm_class(self) -> type:
        return import_named(self.algorithm)


# The algorithm table, by `algo.name`: filled by `config/algorithms.py` (`register_algorithm`), which owns
# it; it lives here, below every config module, so that `AlgoConfig` can name the algorithms in its errors.
ALGORITHMS: dict[str, AlgorithmSpec] = {}

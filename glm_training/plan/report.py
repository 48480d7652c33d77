"""What a memory plan is and how it prints: its terms, the device plan, the loading plan, their tables.

`MemoryPlan` is what one rank holds on its device (`device.py` builds it), `LoadingPlan` the host memory
while a run loads its model (`loading.py`); both are lists of named `Term`s in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glm_training.errors import UserError

GIB = 1024**3


class MemoryPlanError(UserError, RuntimeError):
    """The run is predicted not to fit its GPU; the message names the largest terms and the fixes."""


@dataclass
class Term:
    name: str
    bytes: float
    detail: str = ""


def format_count(n: float) -> str:
    """A parameter count: "1.23B" or "45.6M"."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def format_gib(n: float | None) -> str:
    return f"{(n or 0) / GIB:.2f} GiB"


def _row(t: Term) -> str:
    return f"  {t.name:<34} {format_gib(t.bytes):>9}  {t.detail}"


@dataclass
class MemoryPlan:
    """Per-rank memory terms (bytes); `peak` = static terms + the larger of update and rollout transients."""

    component: str
    strategy: str
    world_size: int
    static: list[Term] = field(default_factory=list)
    activations: Term | None = None
    activations_other: Term | None = None  # the same with checkpointing toggled, for comparison
    rollout: Term | None = None
    device_bytes: int | None = None

    @property
    def peak(self) -> float:
        transient = max(
            self.activations.bytes if self.activations else 0, self.rollout.bytes if self.rollout else 0
        )
        return sum(t.bytes for t in self.static) + transient

    def largest(self, n: int = 3) -> list[Term]:
        terms = [*self.static, *(t for t in (self.activations, self.rollout) if t is not None)]
        return sorted(terms, key=lambda t: -t.bytes)[:n]

    def fits(self) -> bool:
        return self.device_bytes is None or self.peak <= self.device_bytes

    def table(self) -> str:
        lines = [f"memory plan per rank ({self.component}, {self.strategy}, world size {self.world_size}):"]
        lines += [_row(t) for t in self.static]
        lines += [_row(t) for t in (self.activations, self.activations_other, self.rollout) if t is not None]
        room = f" of {format_gib(self.device_bytes)} usable" if self.device_bytes else ""
        lines.append(f"  {'predicted peak':<34} {format_gib(self.peak):>9}{room}")
        return "\n".join(lines)

    def summary(self) -> str:
        top = ", ".join(f"{t.name} {format_gib(t.bytes)}" for t in self.largest())
        return f"predicted peak {format_gib(self.peak)} per rank ({top})"


@dataclass
class LoadingPlan:
    """Per-rank host memory while a run loads and shards its model (bytes above what it held before).

    `terms` add up to `peak`, the moment the most is resident; `way` says how the trained half loads.
    """

    way: str
    device: str
    terms: list[Term] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return sum(t.bytes for t in self.terms)

    def table(self) -> str:
        lines = [f"host memory per rank while loading ({self.way}; trained on {self.device}):"]
        lines += [_row(t) for t in self.terms]
        lines.append(f"  {'predicted peak':<34} {format_gib(self.peak):>9}")
        return "\n".join(lines)

"""vLLM's offline metric records, as `LLM.get_metrics()` returns them: each a name, its labels and its value."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counter:
    """A counter's total since the engine started."""
    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Gauge:
    """A gauge's value at the latest engine step."""
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Vector:
    """A labelled counter family indexed by position (spec decode's per-position acceptance)."""
    name: str
    labels: dict[str, str]
    values: list[int] = field(default_factory=list)

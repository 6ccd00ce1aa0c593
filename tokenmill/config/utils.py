"""Helpers shared by the config dataclasses: field declaration with help/choices, and validation."""
from __future__ import annotations

import dataclasses
from typing import Any


def config_field(default: Any = dataclasses.MISSING, *, help: str, choices: list | tuple | None = None,
                 default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying its help text and allowed values (the CLI is generated from these)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = list(choices)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_choices(obj: Any) -> None:
    """Raise ValueError for any field whose value is not among its declared choices."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices is None:
            continue
        value = getattr(obj, f.name)
        if value is not None and value not in choices:
            raise ValueError(f"Invalid value {value!r} for `{f.name}`; allowed values: "
                             f"{', '.join(map(str, choices))}.")


def check_range(name: str, value: Any, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> None:
    if value is None:
        return
    ok = True
    if lo is not None:
        ok &= value > lo if lo_open else value >= lo
    if hi is not None:
        ok &= value < hi if hi_open else value <= hi
    if not ok:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        raise ValueError(f"Invalid value {value!r} for `{name}`: must be in {lb}{lo}, {hi}{rb}.")


def not_supported_yet(name: str, value: Any, why: str = "") -> ValueError:
    """The error for a value tokenmill cannot honour yet, naming the option as an engine argument and as a flag."""
    extra = f" {why}" if why else ""
    return ValueError(f"`{name}={value!r}` (--{name.replace('_', '-')}) is not supported yet by tokenmill.{extra}")

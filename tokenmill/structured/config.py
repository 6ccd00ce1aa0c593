"""`--structured-outputs-config`: engine-wide structured-output options, with vLLM's names and defaults."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

SUPPORTED_BACKENDS = ("auto", "xgrammar")
KNOWN_UNSUPPORTED_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass
class StructuredOutputsConfig:
    backend: str = "auto"
    """Which library compiles the constraints: "auto" or "xgrammar" (the same thing here). vLLM's "guidance",
    "outlines" and "lm-format-enforcer" are not supported yet and are rejected."""
    disable_fallback: bool = False
    """vLLM: do not fall back to another backend when the first cannot compile a request. tokenmill has one
    backend, so a request it cannot compile is always an error (as if this were true)."""
    disable_any_whitespace: bool = False
    """Generate compact JSON: no whitespace between tokens of JSON outputs (for every request)."""
    disable_additional_properties: bool = False
    """Close every object of a JSON schema: additionalProperties is forced to false, even where the schema
    allows extra keys (for every request). Objects that say nothing are already closed (xgrammar strict mode)."""
    reasoning_parser: str = ""
    """Kept for vLLM compatibility: the reasoning parser whose end-of-thinking marker starts the constrained
    part of the output. Empty means the whole output is constrained."""
    enable_in_reasoning: bool = False
    """vLLM: constrain the reasoning part too (only meaningful with a reasoning parser)."""

    def __post_init__(self) -> None:
        backend = self.backend
        if not isinstance(backend, str):
            raise ValueError(f"structured outputs backend must be a string; got {backend!r}")
        self.backend = backend.strip().lower().replace("_", "-")
        if self.backend in KNOWN_UNSUPPORTED_BACKENDS:
            raise ValueError(f"structured outputs backend {backend!r} is not supported yet by tokenmill; "
                             f"use one of {', '.join(SUPPORTED_BACKENDS)}")
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"unknown structured outputs backend {backend!r}; use one of "
                             f"{', '.join(SUPPORTED_BACKENDS)}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"structured outputs config {name} must be true or false; got {value!r}")
        if not isinstance(self.reasoning_parser, str):
            raise ValueError(f"structured outputs config reasoning_parser must be a string; "
                             f"got {self.reasoning_parser!r}")

    def check_supported(self) -> None:
        """Raise ValueError for options tokenmill accepts from vLLM's spelling but cannot honour yet."""
        if self.reasoning_parser:
            raise ValueError("--structured-outputs-config reasoning_parser: not supported yet by tokenmill (the "
                             "server's --reasoning-parser decides where the constrained answer starts).")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """Build from the --structured-outputs-config value (a dict, or its JSON text); None gives the defaults.

        Keys may use dashes or underscores; an unknown key raises ValueError listing the allowed ones.
        """
        if d is None:
            return cls()
        if isinstance(d, StructuredOutputsConfig):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d) if d.strip() else {}
            except ValueError as e:
                raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"--structured-outputs-config must be a JSON object; got {d!r:.200}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in d.items():
            name = str(key).replace("-", "_")
            if name not in allowed:
                raise ValueError(f"unknown key {key!r} in --structured-outputs-config; allowed keys: "
                                 + ", ".join(allowed))
            kwargs[name] = value
        return cls(**kwargs)

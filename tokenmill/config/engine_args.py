"""Flat engine arguments (what `LLM(**kwargs)` and the CLI take) mapped onto the config dataclasses.

The config dataclasses are the single source of truth: every field of every config is an engine argument with the
same name. A few vLLM aliases are accepted on top, and so are the vLLM engine arguments of config/unsupported.py's
table, with the values it accepts (checked there, with the message the `serve` command line gives).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

from tokenmill.config import CONFIG_CLASSES, TokenmillConfig
from tokenmill.config.unsupported import NOT_YET_SUPPORTED, check_not_yet_supported, engine_option_names

# vLLM spellings that map onto a differently named field.
ALIASES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}


@functools.cache  # the config classes are fixed; callers only read the map
def _field_owner() -> dict[str, type]:
    owner = {}
    for cls in CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            owner[f.name] = cls
    return owner


def all_engine_arg_names() -> list[str]:
    return list(_field_owner())


def _owner_of(name: str, owner: dict[str, type]) -> tuple[str, type | None]:
    """(canonical name, config class) of an engine argument, class None for a not-yet-supported one; TypeError with
    suggestions for an unknown one."""
    name = ALIASES.get(name, name)
    cls = owner.get(name)
    if cls is None and name in NOT_YET_SUPPORTED and not NOT_YET_SUPPORTED[name].frontend:
        return name, None
    if cls is None:
        close = difflib.get_close_matches(name, [*owner, *engine_option_names()], n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise TypeError(f"Unknown engine argument `{name}`.{hint}")
    return name, cls


def create_engine_config(**kwargs: Any) -> TokenmillConfig:
    """Build a validated TokenmillConfig; unknown argument names raise TypeError with suggestions, values of the
    not-yet-supported table other than the accepted ones ValueError."""
    owner = _field_owner()
    per_cls: dict[type, dict[str, Any]] = {cls: {} for cls in CONFIG_CLASSES}
    for name, value in kwargs.items():
        name, cls = _owner_of(name, owner)
        if cls is None:
            check_not_yet_supported(name, value)  # an accepted value changes nothing
            continue
        per_cls[cls][name] = value
    from tokenmill.config import LoadConfig as _Load, ModelConfig as _Model
    # The model is looked up in LoadConfig.download_dir when one is given (vLLM's --download-dir).
    per_cls[_Model]["download_dir"] = per_cls[_Load].get("download_dir")
    configs = {cls: cls(**per_cls[cls]) for cls in CONFIG_CLASSES}
    from tokenmill.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ModelConfig,
                                  LoRAConfig, ParallelConfig, SchedulerConfig, SpeculativeArgs)
    return TokenmillConfig(model_config=configs[ModelConfig], cache_config=configs[CacheConfig],
                           scheduler_config=configs[SchedulerConfig], load_config=configs[LoadConfig],
                           parallel_config=configs[ParallelConfig], device_config=configs[DeviceConfig],
                           compilation_config=configs[CompilationConfig],
                           speculative_config=configs[SpeculativeArgs].parsed,
                           lora_config=configs[LoRAConfig] if configs[LoRAConfig].enable_lora else None)


class EngineArgs:
    """vLLM's `EngineArgs`: engine arguments by name (the config dataclasses' fields, plus ALIASES), for
    `LLMEngine.from_engine_args(args)` / `AsyncLLMEngine.from_engine_args(args)`. Names are checked when given or
    set (TypeError naming an unknown one); values are checked by create_engine_config(). An argument not given
    reads as its config field's default."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_kwargs", {})
        self.model = model
        for name, value in kwargs.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        name, _ = _owner_of(name, _field_owner())
        self._kwargs[name] = value

    def __getattr__(self, name: str) -> Any:
        kwargs = self.__dict__["_kwargs"]
        name = ALIASES.get(name, name)
        if name in kwargs:
            return kwargs[name]
        cls = _field_owner().get(name)
        if cls is None and name in engine_option_names():
            return NOT_YET_SUPPORTED[name].default
        if cls is None:
            raise AttributeError(f"{type(self).__name__} has no engine argument {name!r}")
        f = cls.__dataclass_fields__[name]
        if f.default is not dataclasses.MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None

    def to_kwargs(self) -> dict[str, Any]:
        """The arguments given, by canonical name."""
        return dict(self._kwargs)

    def create_engine_config(self) -> TokenmillConfig:
        return create_engine_config(**self._kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._kwargs.items())})"


class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`: the same arguments, for the serving engine (`AsyncLLMEngine`)."""


def engine_kwargs(engine_args: EngineArgs | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`from_engine_args`' arguments as one dict: an EngineArgs' arguments, then keyword ones (which win)."""
    if engine_args is None:
        return kwargs
    if not isinstance(engine_args, EngineArgs):
        raise TypeError(f"engine_args must be an EngineArgs, got {type(engine_args).__name__}")
    return {**engine_args.to_kwargs(), **kwargs}

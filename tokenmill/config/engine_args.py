"""Flat engine arguments (what `LLM(**kwargs)` and the CLI take) mapped onto the config dataclasses.

The config dataclasses are the single source of truth: every field of every config is an engine argument with the
same name. A few vLLM aliases are accepted on top.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from tokenmill.config import CONFIG_CLASSES, TokenmillConfig

# vLLM spellings that map onto a differently named field.
ALIASES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}


def _field_owner() -> dict[str, type]:
    owner = {}
    for cls in CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            owner[f.name] = cls
    return owner


def all_engine_arg_names() -> list[str]:
    return list(_field_owner())


def create_engine_config(**kwargs: Any) -> TokenmillConfig:
    """Build a validated TokenmillConfig; unknown argument names raise TypeError with suggestions."""
    owner = _field_owner()
    per_cls: dict[type, dict[str, Any]] = {cls: {} for cls in CONFIG_CLASSES}
    for name, value in kwargs.items():
        if name in ALIASES:
            name = ALIASES[name]
        cls = owner.get(name)
        if cls is None:
            close = difflib.get_close_matches(name, list(owner), n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise TypeError(f"Unknown engine argument `{name}`.{hint}")
        per_cls[cls][name] = value
    from tokenmill.config import LoadConfig as _Load, ModelConfig as _Model
    # The model is looked up in LoadConfig.download_dir when one is given (vLLM's --download-dir).
    per_cls[_Model]["download_dir"] = per_cls[_Load].get("download_dir")
    configs = {cls: cls(**per_cls[cls]) for cls in CONFIG_CLASSES}
    from tokenmill.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ModelConfig,
                                  ParallelConfig, SchedulerConfig)
    return TokenmillConfig(model_config=configs[ModelConfig], cache_config=configs[CacheConfig],
                           scheduler_config=configs[SchedulerConfig], load_config=configs[LoadConfig],
                           parallel_config=configs[ParallelConfig], device_config=configs[DeviceConfig],
                           compilation_config=configs[CompilationConfig])

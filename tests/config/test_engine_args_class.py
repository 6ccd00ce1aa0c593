"""vLLM's EngineArgs / AsyncEngineArgs objects over the flat engine arguments (tokenmill/config/engine_args.py)."""
from __future__ import annotations

import pytest

from tokenmill.config.engine_args import AsyncEngineArgs, EngineArgs, engine_kwargs


def test_names_checked_when_given_or_set():
    with pytest.raises(TypeError, match="max_model_lenn.*Did you mean: max_model_len"):
        EngineArgs(model="m", max_model_lenn=5)
    args = EngineArgs(model="m", tp=2)
    assert args.tensor_parallel_size == 2 and args.tp == 2          # vLLM's alias reads the same field
    args.max_model_len = 4096
    assert args.to_kwargs() == {"model": "m", "tensor_parallel_size": 2, "max_model_len": 4096}
    with pytest.raises(TypeError, match="Unknown engine argument `gpu_mem`"):
        args.gpu_mem = 0.5
    with pytest.raises(AttributeError, match="no engine argument 'nonsense'"):
        _ = args.nonsense


def test_unset_arguments_read_as_their_defaults():
    args = AsyncEngineArgs()
    assert isinstance(args, EngineArgs)
    assert args.model is None and args.gpu_memory_utilization == 0.92 and args.enforce_eager is False
    assert "gpu_memory_utilization" not in args.to_kwargs()


def test_values_are_checked_by_the_config():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=1.5).create_engine_config()


def test_engine_kwargs_merge_and_type_check():
    assert engine_kwargs(EngineArgs(model="m", seed=1), {"seed": 2}) == {"model": "m", "seed": 2}
    assert engine_kwargs(None, {"seed": 3}) == {"seed": 3}
    with pytest.raises(TypeError, match="engine_args must be an EngineArgs"):
        engine_kwargs({"model": "m"}, {})

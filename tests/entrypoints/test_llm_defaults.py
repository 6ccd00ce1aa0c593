"""vLLM's offline-class defaults that depend on the GPU (tokenmill/entrypoints/llm.py: offline_defaults)."""
from __future__ import annotations

import types

import pytest
import torch

from tokenmill.config.scheduler import offline_max_num_batched_tokens
from tokenmill.entrypoints import llm as llm_mod

GIB = 2**30


def test_token_budget_by_gpu_size_and_name():
    assert offline_max_num_batched_tokens(141 * GIB, "NVIDIA H200") == 16384
    assert offline_max_num_batched_tokens(80 * GIB, "NVIDIA H100 80GB HBM3") == 16384
    assert offline_max_num_batched_tokens(80 * GIB, "NVIDIA A100-SXM4-80GB") is None   # vLLM: slower on A100s
    assert offline_max_num_batched_tokens(24 * GIB, "NVIDIA L4") is None


@pytest.fixture
def fake_gpu(monkeypatch):
    """A visible CUDA device of the given size and name, as far as offline_defaults can tell."""
    def install(total_gib: int, name: str):
        props = types.SimpleNamespace(total_memory=total_gib * GIB, name=name)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    return install


def test_large_gpu_gets_the_larger_budget(fake_gpu):
    fake_gpu(141, "NVIDIA H200")
    assert llm_mod.offline_defaults({"model": "m"}) == {"model": "m", "max_num_batched_tokens": 16384}
    assert llm_mod.offline_defaults({"device": "cuda", "tp": 1})["max_num_batched_tokens"] == 16384


@pytest.mark.parametrize("kwargs", [
    {"max_num_batched_tokens": 4096},            # given: kept
    {"enable_chunked_prefill": False},           # the budget must then cover max_model_len: the common rule
    {"device": "cpu"},
    {"tensor_parallel_size": 2},                 # workers in other processes
    {"pp": 2},
    {"data_parallel_size": "2"},                 # a bad value is left for the config check to report
])
def test_left_alone(fake_gpu, kwargs):
    fake_gpu(141, "NVIDIA H200")
    assert llm_mod.offline_defaults(dict(kwargs)) == kwargs


def test_small_gpu_and_no_gpu_keep_the_common_default(fake_gpu, monkeypatch):
    fake_gpu(80, "NVIDIA A100-SXM4-80GB")
    assert llm_mod.offline_defaults({}) == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert llm_mod.offline_defaults({}) == {}


def test_the_api_server_defaults_to_a_2048_token_budget():
    """The server's own default (config/scheduler.py: SERVER_MAX_NUM_BATCHED_TOKENS), filled by run_server where
    the command line gives none; `auto` means the default."""
    from tokenmill.config.args import parse_serve_args
    from tokenmill.config.scheduler import server_defaults
    for argv in (["m"], ["m", "--max-num-batched-tokens", "auto"]):
        engine, _ = parse_serve_args(argv)
        assert server_defaults(engine)["max_num_batched_tokens"] == 2048
    engine, _ = parse_serve_args(["m", "--max-num-batched-tokens", "8K"])
    assert server_defaults(engine)["max_num_batched_tokens"] == 8192
    engine, _ = parse_serve_args(["m", "--no-enable-chunked-prefill"])
    assert "max_num_batched_tokens" not in server_defaults(engine)

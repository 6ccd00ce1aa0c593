"""VLLM_CPU_OMP_THREADS_BIND / TOKENMILL_CPU_NUM_THREADS pick the CPU worker's threads and pinning;
VLLM_CPU_KVCACHE_SPACE sizes the CPU KV cache."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import envs
from tokenmill.worker import cpu_threads


@pytest.fixture
def restore_threads(monkeypatch):
    before, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    monkeypatch.setattr(cpu_threads, "FRONTEND_SHARES_CPUS", False)
    yield
    torch.set_num_threads(before)
    os.sched_setaffinity(0, affinity)


def test_cpu_lists_parse_and_bad_ones_name_the_variable():
    assert cpu_threads.parse_cpu_list("0-2,5") == [0, 1, 2, 5]
    assert cpu_threads.parse_cpu_list("3") == [3]
    for bad in ("x", "2-1", "-1", "0-"):
        with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
            cpu_threads.parse_cpu_list(bad)


def test_auto_uses_every_allowed_cpu_offline_and_beside_an_api_server(restore_threads, monkeypatch):
    n = len(os.sched_getaffinity(0))
    with envs.override(VLLM_CPU_OMP_THREADS_BIND="auto", TOKENMILL_CPU_NUM_THREADS=0):
        line = cpu_threads.configure_cpu_threads()
        assert torch.get_num_threads() == n and "not pinned" in line and "API server" not in line
        monkeypatch.setattr(cpu_threads, "FRONTEND_SHARES_CPUS", True)
        line = cpu_threads.configure_cpu_threads()
        assert torch.get_num_threads() == n and "shared with the API server" in line
    with envs.override(VLLM_CPU_OMP_THREADS_BIND="auto", TOKENMILL_CPU_NUM_THREADS=3):
        assert "TOKENMILL_CPU_NUM_THREADS=3" in cpu_threads.configure_cpu_threads()
        assert torch.get_num_threads() == 3


def test_a_cpu_list_pins_the_process_and_runs_one_thread_per_cpu(restore_threads):
    first = min(os.sched_getaffinity(0))
    with envs.override(VLLM_CPU_OMP_THREADS_BIND=f"{first}", TOKENMILL_CPU_NUM_THREADS=0):
        line = cpu_threads.configure_cpu_threads()
    assert os.sched_getaffinity(0) == {first} and torch.get_num_threads() == 1
    assert f"pinned to CPUs [{first}]" in line


def test_lists_must_match_the_ranks_and_the_allowed_cpus(restore_threads):
    with envs.override(VLLM_CPU_OMP_THREADS_BIND="0|1", TOKENMILL_CPU_NUM_THREADS=0):
        with pytest.raises(ValueError, match="2 CPU list"):
            cpu_threads.configure_cpu_threads(0, 1)
    with envs.override(VLLM_CPU_OMP_THREADS_BIND="4096", TOKENMILL_CPU_NUM_THREADS=0):
        with pytest.raises(ValueError, match="not available"):
            cpu_threads.configure_cpu_threads()


def test_nobind_keeps_torchs_thread_count(restore_threads):
    torch.set_num_threads(1)
    with envs.override(VLLM_CPU_OMP_THREADS_BIND="nobind", TOKENMILL_CPU_NUM_THREADS=0):
        cpu_threads.configure_cpu_threads()
    assert torch.get_num_threads() == 1


def _cpu_blocks(path: str) -> int:
    from tokenmill import LLM
    llm = LLM(path, max_model_len=64, max_num_seqs=1 << 20, enforce_eager=True)
    try:
        return llm.llm_engine.engine_core.num_blocks
    finally:
        del llm


def test_vllm_cpu_kvcache_space_sizes_the_cpu_kv_cache(tiny_model_factory):
    path = tiny_model_factory("llama")
    with envs.override(VLLM_CPU_KVCACHE_SPACE=0, TOKENMILL_CPU_KVCACHE_SPACE_GIB=1):
        one = _cpu_blocks(path)
    with envs.override(VLLM_CPU_KVCACHE_SPACE=2, TOKENMILL_CPU_KVCACHE_SPACE_GIB=1):
        two = _cpu_blocks(path)
    assert two == 2 * one > 0
    with envs.override(VLLM_CPU_KVCACHE_SPACE=0, TOKENMILL_CPU_KVCACHE_SPACE_GIB=0):
        with pytest.raises(ValueError, match="TOKENMILL_CPU_KVCACHE_SPACE_GIB=0"):
            _cpu_blocks(path)


def test_cpu_kv_cache_larger_than_available_memory_is_refused_at_start_up(tiny_model_factory, monkeypatch):
    # The cache's pages are committed on first write, so without this check an over-large cache would fail
    # mid-serving instead of at start-up.
    from tokenmill.attention import kv_cache_memory
    path = tiny_model_factory("llama")
    monkeypatch.setattr(kv_cache_memory, "available_host_bytes", lambda: 1 << 30)
    with envs.override(VLLM_CPU_KVCACHE_SPACE=2, TOKENMILL_CPU_KVCACHE_SPACE_GIB=1):
        with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=2: a 2\.0 GiB CPU KV cache does not fit"):
            _cpu_blocks(path)
    monkeypatch.setattr(kv_cache_memory, "available_host_bytes", lambda: 4 << 30)
    with envs.override(VLLM_CPU_KVCACHE_SPACE=2, TOKENMILL_CPU_KVCACHE_SPACE_GIB=1):
        assert _cpu_blocks(path) > 0

"""LLM.start_profile() / stop_profile(): torch profiler traces in VLLM_TORCH_PROFILER_DIR, as vLLM writes them; a
clear error without the variable, or when stopped before started."""
from __future__ import annotations

import gzip
import json

import pytest

from tokenmill import LLM, SamplingParams, envs


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(tiny_model_factory("llama"), max_model_len=64, num_gpu_blocks_override=16)


def test_profile_writes_a_trace(llm, tmp_path):
    with envs.override(VLLM_TORCH_PROFILER_DIR=str(tmp_path / "traces"), VLLM_TORCH_PROFILER_WITH_STACK=False):
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running"):
            llm.start_profile()
        llm.generate("hello there", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        llm.stop_profile()
    traces = list((tmp_path / "traces").glob("rank0.*.pt.trace.json.gz"))
    assert len(traces) == 1
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


def test_profile_without_the_directory_is_a_clear_error(llm):
    with envs.override(VLLM_TORCH_PROFILER_DIR=None):
        with pytest.raises(RuntimeError, match="set VLLM_TORCH_PROFILER_DIR"):
            llm.start_profile()
    with pytest.raises(RuntimeError, match="not running; call start_profile"):
        llm.stop_profile()

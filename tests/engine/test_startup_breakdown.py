"""The start-up breakdown: one log line with the phases of EngineCore's construction, and Triton compile time."""
from __future__ import annotations

import logging
import types

import pytest

from tokenmill.engine.engine_core import format_startup
from tokenmill.kernels.compile_stats import CompileStats


def test_format_startup_lists_every_phase_and_the_total():
    line = format_startup({"workers and weights": 3.21, "memory profile": 1.0, "KV cache and CUDA graphs": 2.55,
                           "total": 6.8})
    assert line == "6.8 s: workers and weights 3.2 s, memory profile 1.0 s, KV cache and CUDA graphs 2.5 s"


def test_compile_stats_sums_compiles_not_cache_hits_and_restores_the_listener():
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        pytest.skip("this triton has no compilation listener")
    seen = []
    previous = lambda **kw: seen.append(kw["cache_hit"])  # noqa: E731
    knobs.compilation.listener = previous
    try:
        stats = CompileStats.track()
        assert stats.available
        t = types.SimpleNamespace(ir_initialization=500_000, lowering_stages=[("ttir", 250_000), ("ptx", 250_000)],
                                  store_results=0)
        for hit in (False, True, False):
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=t, cache_hit=hit)
        stats.stop()
        assert knobs.compilation.listener is previous
        assert (stats.compiled, stats.cache_hits) == (2, 1) and stats.seconds == pytest.approx(2.0)
        assert seen == [False, True, False]  # the listener that was there still hears every compile
        assert stats.describe() == "2.0 s for 2 Triton kernels (1 from cache)"
    finally:
        knobs.compilation.listener = None


def test_engine_logs_one_startup_line(tiny_model_factory, caplog):
    from tokenmill import LLM
    path = tiny_model_factory("llama")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(path, max_model_len=128, skip_tokenizer_init=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine ready in ")]
    assert len(lines) == 1, lines
    for phase in ("workers and weights", "memory profile", "KV cache and CUDA graphs"):
        assert phase in lines[0]
    seconds = llm.llm_engine.engine_core.startup_seconds
    assert seconds["total"] >= seconds["workers and weights"] > 0


def test_the_load_line_reports_the_checkpoints_read_rate(tiny_model_factory, tm_log):
    """T3's weights figure: how fast the checkpoint went from its files into the parameters."""
    import os
    import re

    from tokenmill import LLM
    d = tiny_model_factory("llama")
    with tm_log.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(d, max_model_len=64, num_gpu_blocks_override=16)
    del llm
    line = next(r.getMessage() for r in tm_log.records if r.getMessage().startswith("Loaded "))
    m = re.search(r"; read ([\d.]+) GiB in ([\d.]+) s \(([\d.]+) GB/s\)$", line)
    assert m, line
    size = os.path.getsize(os.path.join(d, "model.safetensors"))
    assert abs(float(m.group(1)) - size / 2**30) < 0.01  # every tensor of the file, its header aside

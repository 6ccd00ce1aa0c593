"""CompilationConfig: which batches get CUDA graphs."""
from __future__ import annotations

import pytest

from tokenmill.config.compilation import CompilationConfig


def test_cudagraph_mode_choices():
    assert CompilationConfig(cudagraph_mode="full_decode_only").cudagraph_mode == "FULL_DECODE_ONLY"
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CompilationConfig(cudagraph_mode="sometimes")


def test_mixed_capture_sizes_follow_mode_and_limits():
    assert CompilationConfig().mixed_capture_sizes(8192, 256) == [(16, 16), (32, 32), (64, 64), (128, 128),
                                                                   (256, 256), (512, 256)]
    assert CompilationConfig().mixed_capture_sizes(100, 8) == [(16, 8), (32, 8), (64, 8)]
    assert CompilationConfig(max_cudagraph_capture_size=64).mixed_capture_sizes(8192, 256)[-1] == (64, 64)
    assert CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY").mixed_capture_sizes(8192, 256) == []
    assert not CompilationConfig(cudagraph_mode="NONE").graphs_enabled


def test_graph_output_rows_count_every_captured_graph():
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8])
    assert cc.graph_output_rows(8, 64) == (1 + 2 + 4 + 8) + (8 + 8 + 8)  # mixed: 16/32/64 tokens, 8 requests each
    assert CompilationConfig(cudagraph_capture_sizes=[1, 2], cudagraph_mode="FULL_DECODE_ONLY").graph_output_rows(
        8, 64) == 3
    assert CompilationConfig(cudagraph_mode="NONE").graph_output_rows(256, 8192) == 0

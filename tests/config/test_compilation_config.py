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

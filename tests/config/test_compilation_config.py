"""CompilationConfig: which batches get CUDA graphs."""
from __future__ import annotations

import pytest

from tokenmill.config.compilation import CompilationConfig, default_capture_sizes, mixed_capture_sizes


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


def test_capture_size_tables():
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert mixed_capture_sizes(100, 48) == [(16, 16), (32, 32), (64, 48)]
    assert CompilationConfig(max_cudagraph_capture_size=20).capture_sizes(256) == default_capture_sizes(20)
    assert CompilationConfig(cudagraph_capture_sizes=[4, 64, 1]).capture_sizes(32) == [1, 4]


def test_graph_output_rows_are_the_largest_graphs_logits():
    """One logits buffer shared by every graph: as many rows as the largest graph returns."""
    cc = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8])
    assert cc.graph_output_rows(8, 64) == 8              # decode 8 rows; mixed 16/32/64 tokens, 8 requests each
    assert CompilationConfig().graph_output_rows(4, 512) == 4
    assert CompilationConfig(cudagraph_capture_sizes=[1, 2], cudagraph_mode="FULL_DECODE_ONLY").graph_output_rows(
        8, 64) == 2
    assert CompilationConfig(cudagraph_capture_sizes=[1, 2]).graph_output_rows(64, 64) == 64   # mixed: 64 requests
    assert CompilationConfig(cudagraph_mode="NONE").graph_output_rows(256, 8192) == 0


def test_vllm_compilation_config_sets_the_graph_fields():
    c = CompilationConfig(compilation_config={"mode": 3, "cudagraph_capture_sizes": [1, 2, 4, 8],
                                              "cudagraph_mode": "full_decode_only"})
    assert c.cudagraph_capture_sizes == [1, 2, 4, 8] and c.cudagraph_mode == "FULL_DECODE_ONLY"
    assert CompilationConfig(compilation_config=3).graphs_enabled          # LLM(compilation_config=3)
    with pytest.raises(ValueError, match=r"pass_config.*not supported yet"):
        CompilationConfig(compilation_config={"pass_config": {"fuse_norm_quant": True}})
    with pytest.raises(ValueError, match="given twice"):
        CompilationConfig(cudagraph_mode="FULL", compilation_config={"cudagraph_mode": "NONE"})
    with pytest.raises(ValueError, match="compilation_config.mode"):
        CompilationConfig(compilation_config={"mode": 9})


def test_optimization_levels_pick_the_graphs():
    assert not CompilationConfig(optimization_level=0).graphs_enabled
    assert CompilationConfig(optimization_level=1).mixed_capture_sizes(8192, 256) == []
    assert CompilationConfig(optimization_level=3).mixed_capture_sizes(8192, 256)
    assert CompilationConfig(optimization_level=0, cudagraph_mode="FULL").graphs_enabled  # explicit mode wins
    with pytest.raises(ValueError, match="optimization_level"):
        CompilationConfig(optimization_level=4)


def test_verify_graphs_hold_up_to_the_token_limit():
    """Verifying k drafts: the decode sizes whose (k + 1)-token rows fit max_cudagraph_capture_size tokens (512
    unset), whatever the largest decode batch is; the shared logits buffer grows to the largest of them."""
    cc = CompilationConfig()
    assert cc.verify_capture_sizes(8, 5) == [1, 2, 4, 8]         # 40 tokens: more than the 8-request decode graph
    assert cc.verify_capture_sizes(256, 5)[-1] == 96             # 96 * 5 <= 512 < 104 * 5
    assert cc.verify_capture_sizes(256, 1) == []
    assert CompilationConfig(max_cudagraph_capture_size=64).verify_capture_sizes(256, 5) == [1, 2, 4, 8]
    assert CompilationConfig(cudagraph_mode="NONE").verify_capture_sizes(8, 5) == []
    assert cc.graph_output_rows(8, 64, verify_q=5) == 40
    assert cc.graph_output_rows(256, 8192, verify_q=5) == 480

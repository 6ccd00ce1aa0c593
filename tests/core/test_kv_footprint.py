"""The KV footprint of one long request on a sliding-window model's shape (issue 27's Gemma-3 target), from the
real scheduler and KV cache managers driven by a fake runner (tokenmill/benchmarks/kv_footprint.py)."""
from __future__ import annotations

import pytest

from tokenmill.benchmarks.kv_footprint import main, peak_kv_bytes

GEMMA3 = "tokenmill/model_configs/gemma-3-4b"


@pytest.mark.parametrize("budget, most", [(2048, 0.30), (8192, 0.40)])
def test_gemma3_holds_a_fraction_of_the_all_global_kv(budget, most):
    """Five window-1024 layers to one global: a 32k request holds the global layers' whole context and the
    sliding layers' window plus one prefill chunk: 22% of the all-global bytes at the API server's default
    budget (2048), 37% at 8192."""
    r = peak_kv_bytes(GEMMA3, 32000, 256, budget)
    (kind_s, layers_s, blocks_s, _), (kind_f, layers_f, blocks_f, _) = sorted(r["groups"], reverse=True)
    assert (kind_s, layers_s, kind_f, layers_f) == ("sliding_attention(window=1024)", 29, "full_attention", 5)
    assert blocks_f <= -(-32256 // 16)        # the global layers keep the context so far (the peak is in prefill)
    assert 1024 // 16 < blocks_s <= (1024 + budget) // 16 + 2             # the window and one chunk, no more
    assert r["ratio"] <= most


def test_a_model_without_windows_holds_all_of_it(capsys):
    r = peak_kv_bytes("tokenmill/model_configs/qwen3-0.6b", 3000, 16, 2048)
    assert r["ratio"] == pytest.approx(1.0)
    assert main(["--model", "gemma-3-4b", "--prompt-len", "4000", "--output-len", "8",
                 "--max-num-batched-tokens", "1024"]) == 0
    assert "sliding_attention(window=1024): 29 layers" in capsys.readouterr().out

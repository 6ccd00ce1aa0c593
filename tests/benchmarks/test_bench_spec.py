"""`tokenmill bench spec` end to end on a tiny fp32 model: every method's greedy tokens equal no drafts'."""
from __future__ import annotations

import json


def test_bench_spec_reports_each_method_and_identical_tokens(tiny_model_factory, capsys):
    from tokenmill.benchmarks.spec_decode import main
    assert main(["--model", tiny_model_factory("llama"), "--max-tokens", "6", "--rounds", "1",
                 "--dtype", "float32", "--max-model-len", "512"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["results"]) == {f"{k}/{m}" for k in ("quoting", "ordinary") for m in ("none", "ngram", "suffix")}
    assert out["identical_prompts"] == 8
    assert all(r["tok_s"] > 0 and r["tokens"] > 0 for r in out["results"].values())
    # Decoding alone (after each reply's first token) runs faster than the whole request, which includes prefill.
    assert all(r["decode_tok_s"] > r["tok_s"] for r in out["results"].values())

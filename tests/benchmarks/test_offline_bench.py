"""`tokenmill bench throughput|latency` on a tiny model (CPU): they run and report consistent numbers."""
from __future__ import annotations

import json

import pytest

from tokenmill.benchmarks import latency, throughput
from tokenmill.benchmarks.offline_common import random_token_prompts, shipped_model_dir


def test_random_prompts_lengths_and_determinism():
    p1, o1 = random_token_prompts(50, 100, 40, 0.5, 1000, seed=3)
    p2, o2 = random_token_prompts(50, 100, 40, 0.5, 1000, seed=3)
    assert p1 == p2 and o1 == o2
    assert all(50 <= len(p) <= 150 for p in p1) and all(20 <= n <= 60 for n in o1)
    assert shipped_model_dir("qwen3-0.6b").endswith("qwen3-0.6b")


def test_throughput_and_latency_run(tiny_model_factory, tmp_path, capsys):
    d = tiny_model_factory("llama")
    out = tmp_path / "tp.json"
    res = throughput.main(["--model", d, "--num-prompts", "6", "--input-len", "16", "--output-len", "5",
                           "--max-model-len", "128", "--output-json", str(out)])
    assert res["total_output_tokens"] == 30 and res["output_tokens_per_second"] > 0
    assert json.loads(out.read_text())["num_requests"] == 6
    assert "Throughput:" in capsys.readouterr().out
    lat = latency.main(["--model", d, "--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "2",
                        "--num-iters-warmup", "1", "--max-model-len", "128"])
    assert len(lat["latencies"]) == 2 and lat["avg_latency"] > 0


def test_throughput_hf_backend_runs_and_rejects_engine_flags(tiny_model_factory):
    d = tiny_model_factory("llama")
    common = ["--model", d, "--backend", "hf", "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
              "--max-model-len", "64"]
    res = throughput.main(common)
    assert res["backend"] == "hf" and res["total_output_tokens"] == 6 and res["output_tokens_per_second"] > 0
    with pytest.raises(ValueError, match="--backend hf does not use --enforce-eager, --max-num-seqs"):
        throughput.main(common + ["--max-num-seqs", "4", "--enforce-eager"])

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
    assert res["num_preemptions"] == 0   # six short requests never outgrow the KV pool
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


def _spy_generate(monkeypatch) -> list:
    """Record what the real LLM.generate is asked for and returns (the engine still runs)."""
    from tokenmill.entrypoints.llm import LLM
    calls = []
    real = LLM.generate

    def spy(self, prompts, params=None, **kw):
        outs = real(self, prompts, params, **kw)
        calls.append((params, [list(o.outputs[0].token_ids) for o in outs]))
        return outs
    monkeypatch.setattr(LLM, "generate", spy)
    return calls


def test_throughput_sampling_flags_reach_the_engine(tiny_model_factory, monkeypatch):
    d = tiny_model_factory("llama")
    calls = _spy_generate(monkeypatch)
    common = ["--model", d, "--num-prompts", "4", "--input-len", "12", "--output-len", "6", "--max-model-len", "128"]
    greedy = throughput.main(common + ["--temperature", "0"])
    assert greedy["temperature"] == 0 and calls[-1][0][0].temperature == 0
    greedy_tokens = calls[-1][1]
    top1 = throughput.main(common + ["--temperature", "0.6", "--top-k", "1"])
    params, top1_tokens = calls[-1]
    assert (params[0].temperature, params[0].top_k, top1["top_k"]) == (0.6, 1, 1)
    assert top1_tokens == greedy_tokens  # keeping only the most likely token is greedy decoding
    throughput.main(common + ["--temperature", "0.6", "--top-p", "0.95"])
    params, sampled_tokens = calls[-1]
    assert all((p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 0) for p in params)
    assert sampled_tokens != greedy_tokens  # random weights: a real draw leaves the argmax path


def test_min_p_flag_reaches_the_engine_and_latency_takes_the_sampling_flags(tiny_model_factory, monkeypatch):
    d = tiny_model_factory("llama")
    calls = _spy_generate(monkeypatch)
    common = ["--model", d, "--max-model-len", "128"]
    res = throughput.main(common + ["--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                                    "--temperature", "0.6", "--min-p", "0.05"])
    assert res["min_p"] == 0.05 and all((p.temperature, p.min_p) == (0.6, 0.05) for p in calls[-1][0])
    lat_common = common + ["--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                           "--num-iters-warmup", "0"]
    lat = latency.main(lat_common + ["--temperature", "0.7", "--top-k", "20", "--top-p", "0.8", "--min-p", "0.05"])
    p = calls[-1][0]
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.7, 20, 0.8, 0.05)
    assert (lat["temperature"], lat["top_k"], lat["top_p"], lat["min_p"]) == (0.7, 20, 0.8, 0.05)
    greedy = latency.main(lat_common + ["--temperature", "0"])
    assert greedy["temperature"] == 0 and calls[-1][0].temperature == 0
    with pytest.raises(ValueError, match="min_p"):
        latency.main(["--model", "qwen3-0.6b", "--min-p", "1.5"])


def test_throughput_refuses_bad_sampling_values_before_loading():
    # Refused by SamplingParams' own check, named by field, before the engine (or HF) starts.
    with pytest.raises(ValueError, match="top_p"):
        throughput.main(["--model", "qwen3-0.6b", "--top-p", "1.5", "--num-prompts", "1"])
    with pytest.raises(ValueError, match="top_k"):
        throughput.main(["--model", "qwen3-0.6b", "--top-k", "-2", "--num-prompts", "1", "--backend", "hf"])
    with pytest.raises(ValueError, match="min_p"):
        throughput.main(["--model", "qwen3-0.6b", "--min-p", "-0.1", "--num-prompts", "1"])


def test_throughput_hf_backend_takes_the_sampling_flags(tiny_model_factory):
    d = tiny_model_factory("llama")
    res = throughput.main(["--model", d, "--backend", "hf", "--num-prompts", "2", "--input-len", "8", "--output-len",
                           "3", "--max-model-len", "64", "--temperature", "0.6", "--top-p", "0.95", "--top-k", "5",
                           "--min-p", "0.05"])
    assert (res["temperature"], res["top_p"], res["top_k"], res["min_p"]) == (0.6, 0.95, 5, 0.05)
    assert res["total_output_tokens"] == 6

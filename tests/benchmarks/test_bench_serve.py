"""`tokenmill bench serve` against an in-process fake OpenAI-compatible server (fake_openai.py).

The fake tokenizer maps id i <-> word "w{i}", so /tokenize and /detokenize round-trip exactly and prompt
lengths are checkable; completions stream one word per token with small sleeps.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.benchmarks.fake_openai import MODEL, run_bench
from tokenmill.benchmarks import serve


EXPECTED_LINES = ["============ Serving Benchmark Result ============", "Successful requests:",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Peak output token throughput (tok/s):", "Peak concurrent requests:",
                  "Total token throughput (tok/s):", "---------------Time to First Token----------------",
                  "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
                  "---------------Inter-token Latency----------------", "Mean ITL (ms):", "P99 ITL (ms):",
                  "=================================================="]


def test_max_concurrency_metrics_and_saved_result(fake, tmp_path, capsys):
    res = run_bench(fake, "--max-concurrency", "4", "--save-result", "--result-dir", str(tmp_path),
                    "--metadata", "gpu=h200", "run=1", "--api-key", "sekret",
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99")
    out = capsys.readouterr().out
    assert res["completed"] == 20 and res["failed"] == 0
    assert res["total_input_tokens"] == 20 * 16 and res["total_output_tokens"] == 20 * 8
    assert all(0 < t < e for t, e in zip(res["ttfts"], res["e2els"]))
    assert res["mean_ttft_ms"] < res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0
    assert all(len(itl) == 7 for itl in res["itls"])
    assert fake.peak == 4 and res["max_concurrent_requests"] <= 4
    assert fake.auth == {"Bearer sekret"}
    # Model discovered through /v1/models; random dataset sends ignore_eos, greedy, streaming with usage.
    p = fake.payloads[0]
    assert p["model"] == MODEL and p["ignore_eos"] is True and p["temperature"] == 0.0 and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["max_tokens"] == 8
    for line in EXPECTED_LINES + ["Maximum request concurrency:", "End-to-end Latency", "P50 E2EL (ms):"]:
        assert line in out, line
    assert "Request rate configured (RPS):" not in out
    assert "{:<40} {:<10}".format("Successful requests:", 20) in out
    assert "{:<40} {:<10}".format("Maximum request concurrency:", 4) in out
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].name.startswith("openai-infqps-concurrency4-tiny-model-")
    saved = json.loads(files[0].read_text())
    for key in ("date", "model_id", "num_prompts", "request_rate", "max_concurrency", "completed", "failed",
                "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "mean_tpot_ms", "p99_itl_ms",
                "input_lens", "output_lens", "ttfts", "itls", "errors", "max_output_tokens_per_s"):
        assert key in saved, key
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 4 and saved["num_prompts"] == 20
    assert saved["model_id"] == MODEL and saved["gpu"] == "h200" and saved["run"] == "1"
    assert saved["completed"] == 20 and len(saved["ttfts"]) == 20


def test_request_rate_poisson(fake, capsys, tmp_path):
    res = run_bench(fake, "--request-rate", "50", "--save-result", "--result-dir", str(tmp_path),
                    "--result-filename", "r.json")
    out = capsys.readouterr().out
    assert res["completed"] == 20 and res["failed"] == 0
    expected = serve.arrival_offsets(20, 50.0, 1.0, 0)[-1]
    assert res["duration"] >= expected  # the last request cannot start before its arrival time
    assert "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 50.0) in out
    assert "Maximum request concurrency:" not in out.split("=====")[-2]  # not in the block when unset
    for line in EXPECTED_LINES:
        assert line in out, line
    assert json.loads((tmp_path / "r.json").read_text())["request_rate"] == 50.0


def test_failing_server_counts_failures(fake, capsys):
    fake.fail = True
    res = run_bench(fake, "--max-concurrency", "4")
    cap = capsys.readouterr()
    assert res["completed"] == 0 and res["failed"] == 20 and res["total_output_tokens"] == 0
    assert res["mean_ttft_ms"] == 0.0
    assert "{:<40} {:<10}".format("Failed requests:", 20) in cap.out
    assert "HTTP 500" in cap.err and "boom" in cap.err
    assert all(e.startswith("HTTP 500") for e in res["errors"])


def test_chat_backend(fake):
    res = run_bench(fake, "--backend", "openai-chat", "--max-concurrency", "8", "--model", MODEL)
    assert res["completed"] == 20 and res["total_output_tokens"] == 160
    p = fake.payloads[0]
    assert p["messages"][0]["role"] == "user" and p["max_completion_tokens"] == 8 and "prompt" not in p
    # The role-only first delta is not a token: each request has 8 content chunks -> 7 gaps.
    assert all(len(itl) == 7 for itl in res["itls"])


def test_local_tokenizer(fake, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    res = run_bench(fake, "--tokenizer", str(tmp_path / "tok"), "--max-concurrency", "4")
    assert res["completed"] == 20 and res["total_input_tokens"] == 20 * 16
    assert res["tokenizer_id"] == str(tmp_path / "tok")
    assert "[UNK]" not in fake.payloads[0]["prompt"]  # special tokens are never sampled


class WordTokenizer:
    pool = np.arange(1, 500)

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_random_lengths_prefix_and_seed():
    reqs = serve.sample_random_requests(WordTokenizer(), 200, 100, 50, 0.5, 10, seed=3)
    assert all(10 + 50 <= r.prompt_len <= 10 + 150 for r in reqs)
    assert all(25 <= r.output_len <= 75 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    assert len({" ".join(r.prompt.split()[:10]) for r in reqs}) == 1  # shared prefix
    assert len({r.prompt_len for r in reqs}) > 10
    again = serve.sample_random_requests(WordTokenizer(), 200, 100, 50, 0.5, 10, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_arrival_offsets():
    assert not serve.arrival_offsets(5, float("inf"), 1.0, 0).any()
    for burstiness in (1.0, 0.5, 4.0):
        offs = serve.arrival_offsets(20001, 100.0, burstiness, 0)
        assert offs[0] == 0 and np.all(np.diff(offs) >= 0)
        assert abs(offs[-1] / 20000 - 0.01) < 0.0005  # mean gap = 1 / rate whatever the burstiness
    cv = lambda b: (lambda g: g.std() / g.mean())(np.diff(serve.arrival_offsets(20001, 100.0, b, 0)))
    assert cv(0.5) > cv(1.0) > cv(4.0)


def test_rejects_bad_arguments(fake):
    with pytest.raises(ValueError, match="only 'random'"):
        run_bench(fake, "--dataset-name", "sharegpt")
    with pytest.raises(ValueError, match="range-ratio"):
        run_bench(fake, "--random-range-ratio", "1.5")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        run_bench(fake, "--metadata", "novalue")


def test_token_chunks_count_as_vllm_counts_them():
    """A completions chunk is a generated token even when its text is empty (a token that completes no character
    yet): streams of such tokens are measured, not failed. A chat chunk counts once it carries content."""
    from tokenmill.benchmarks.serve import _is_token_chunk
    assert _is_token_chunk([{"index": 0, "text": "", "finish_reason": None}])
    assert _is_token_chunk([{"index": 0, "text": "hi", "finish_reason": "length"}])
    assert not _is_token_chunk([{"index": 0, "text": "", "finish_reason": "length"}])
    assert not _is_token_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    assert _is_token_chunk([{"index": 0, "delta": {"content": "x"}}])
    assert not _is_token_chunk([])

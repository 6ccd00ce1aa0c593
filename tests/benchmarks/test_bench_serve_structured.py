"""`bench serve --structured-output-ratio`: the constraint pools, how constraints are sent, the structured/free split
of the report (against the fake server of fake_openai.py), and one short run against the real server."""
from __future__ import annotations

import copy
import json
import re

import pytest

from tests.benchmarks.fake_openai import (FREE_TOKEN_S, REGEX_SAMPLES, STRUCTURED_TOKEN_S, answer_for, example,
                                          run_bench)
from tokenmill.benchmarks import structured_dataset as sd


# ----- the constraint pools ---------------------------------------------------------------------------------------

def test_flags_are_interleaved_and_counted():
    assert sd.structured_flags(6, 0.5) == [False, True] * 3
    assert sd.structured_flags(8, 0.25) == [False, False, False, True] * 2
    assert sd.structured_flags(5, 0.0) == [False] * 5 and sd.structured_flags(5, 1.0) == [True] * 5
    for n, r in ((320, 0.5), (101, 0.3), (7, 1 / 3), (1000, 0.01)):
        flags = sd.structured_flags(n, r)
        assert sum(flags) == round(n * r)
        # Evenly spread: any w consecutive requests hold w * r structured ones, less than one off.
        for w in (2, 3, 10, 50):
            assert all(abs(sum(flags[i:i + w]) - w * sum(flags) / n) < 1 for i in range(n - w + 1)), (n, r, w)
    with pytest.raises(ValueError, match="structured-output-ratio"):
        sd.structured_flags(4, 1.5)


def test_constraints_cycle_and_compile_with_xgrammar():
    from tokenmill.structured import StructuredOutputsConfig, StructuredOutputsParams
    from tokenmill.structured.backend_xgrammar import validate_structured_outputs
    assert len(sd.JSON_SCHEMAS) >= 12 and len({json.dumps(s) for s in sd.JSON_SCHEMAS}) == len(sd.JSON_SCHEMAS)
    for kind, pool in (("json", sd.JSON_SCHEMAS), ("regex", sd.REGEXES), ("choice", sd.CHOICES)):
        assert [sd.constraint_for(kind, k) for k in range(2 * len(pool))] == pool * 2
        for spec in pool:  # every constraint the benchmark sends is one the server accepts, in both whitespace modes
            for daw in (False, True):
                validate_structured_outputs(StructuredOutputsParams(**{kind: spec}, disable_any_whitespace=daw),
                                            StructuredOutputsConfig())
    with pytest.raises(ValueError, match="structured-output-kind"):
        sd.constraint_for("grammar", 0)


def test_schemas_are_varied():
    def walk(s):
        yield s
        for sub in list(s.get("properties", {}).values()) + ([s["items"]] if "items" in s else []):
            yield from walk(sub)
    nodes = [n for s in sd.JSON_SCHEMAS for n in walk(s)]
    assert sum(1 for s in sd.JSON_SCHEMAS if any(n is not s and n.get("type") == "object" for n in walk(s))) >= 4
    assert sum(1 for n in nodes if n.get("type") == "array") >= 8
    assert sum(1 for n in nodes if "enum" in n) >= 8
    assert sum(1 for n in nodes if "minimum" in n and "maximum" in n) >= 15
    assert sum(1 for n in nodes if "pattern" in n) >= 3


def test_answer_validation():
    for schema in sd.JSON_SCHEMAS:
        good = example(schema)
        assert sd.answer_is_valid("json", schema, json.dumps(good)), schema
        assert not sd.answer_is_valid("json", schema, json.dumps(good)[:-1])  # truncated: does not parse
        missing = dict(good)
        missing.pop(schema["required"][0])
        assert not sd.fits_schema(schema, missing)
    person = sd.JSON_SCHEMAS[0]
    ok = {"name": "Ada", "age": 36, "tags": ["ab", "cd"]}
    assert sd.fits_schema(person, ok)
    for key, bad in (("age", 121), ("age", True), ("age", 3.5), ("name", "ab"), ("name", "x" * 13),
                     ("tags", ["ab"]), ("tags", ["ab", "cd", "ef", "gh"]), ("tags", ["ab", 3])):
        assert not sd.fits_schema(person, {**ok, key: bad}), (key, bad)
    ticket = sd.JSON_SCHEMAS[11]
    good = example(ticket)
    assert not sd.fits_schema(ticket, {**good, "id": "TCK-1"})  # pattern
    assert not sd.fits_schema(ticket, {**good, "priority": "whenever"})  # enum
    assert not sd.fits_schema(ticket, {**good, "assignee": {"name": "Bo", "team": "sales"}})  # nested enum
    for regex, sample in REGEX_SAMPLES.items():
        assert sd.answer_is_valid("regex", regex, sample) and not sd.answer_is_valid("regex", regex, sample + "!")
    assert set(REGEX_SAMPLES) == set(sd.REGEXES)
    assert sd.answer_is_valid("choice", ["yes", "no"], "no") and not sd.answer_is_valid("choice", ["yes"], "yes ")


def test_add_constraint_fields():
    schema, base = sd.JSON_SCHEMAS[3], {"model": "m", "prompt": "p", "max_tokens": 9, "ignore_eos": True}
    p = copy.deepcopy(base)
    sd.add_constraint(p, "openai", "json", schema, 3, False)
    assert p["structured_outputs"] == {"json": schema} and "ignore_eos" not in p and p["max_tokens"] == 9
    p = copy.deepcopy(base)
    sd.add_constraint(p, "openai", "regex", sd.REGEXES[0], 0, True)
    assert p["structured_outputs"] == {"regex": sd.REGEXES[0], "disable_any_whitespace": True}
    chat = {"model": "m", "messages": [], "max_completion_tokens": 9, "ignore_eos": True}
    p = copy.deepcopy(chat)
    sd.add_constraint(p, "openai-chat", "json", schema, 3, False)
    assert p["response_format"] == {"type": "json_schema",
                                    "json_schema": {"name": "bench_schema_3", "schema": schema, "strict": True}}
    assert "structured_outputs" not in p and "ignore_eos" not in p
    p = copy.deepcopy(chat)
    sd.add_constraint(p, "openai-chat", "json", schema, 3, True)  # response_format cannot say "no whitespace"
    assert p["structured_outputs"] == {"json": schema, "disable_any_whitespace": True} and "response_format" not in p
    p = copy.deepcopy(chat)
    sd.add_constraint(p, "openai-chat", "choice", ["a", "b"], 0, False)
    assert p["structured_outputs"] == {"choice": ["a", "b"]}


# ----- bench serve against the fake server ----------------------------------------------------------------------

def test_mixed_run_splits_metrics(fake, tmp_path, capsys):
    res = run_bench(fake, "--num-prompts", "24", "--max-concurrency", "4", "--structured-output-ratio", "0.5",
                    "--save-result", "--result-dir", str(tmp_path), "--result-filename", "mixed.json",
                    "--output-json", str(tmp_path / "copy.json"), "--metric-percentiles", "50,99")
    out = capsys.readouterr().out
    assert res["completed"] == 24 and res["failed"] == 0
    assert res["structured_flags"] == [False, True] * 12
    sent = [p for p in fake.payloads if "structured_outputs" in p]
    assert len(sent) == 12 and len(fake.payloads) == 24
    assert all("ignore_eos" not in p for p in sent)
    assert all(p["ignore_eos"] is True for p in fake.payloads if "structured_outputs" not in p)
    assert sorted(json.dumps(p["structured_outputs"]["json"]) for p in sent) == sorted(
        json.dumps(s) for s in sd.JSON_SCHEMAS)  # 12 structured requests = the 12 schemas once each
    s, f = res["structured"], res["free"]
    assert s["num_requests"] == s["completed"] == 12 and f["num_requests"] == f["completed"] == 12
    # Free requests: 8 tokens each; structured: one "token" per 3 characters of the answer.
    assert f["total_output_tokens"] == 12 * 8
    texts = [t for t, flag in zip(res["generated_texts"], res["structured_flags"]) if flag]
    assert s["total_output_tokens"] == sum(-(-len(t) // 3) for t in texts)
    assert res["total_output_tokens"] == s["total_output_tokens"] + f["total_output_tokens"]
    # The fake cuts the answer to schema 0 in half: 11 of 12 are valid.
    assert s["valid_outputs"] == 11 and s["valid_output_rate"] == pytest.approx(100 * 11 / 12)
    assert res["structured_valid"].count(False) == 1 and res["structured_valid"][0::2] == [None] * 12
    assert answer_for("json", sd.JSON_SCHEMAS[0])[1] == "length"
    for g in (s, f):
        for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p50_itl_ms", "mean_e2el_ms"):
            assert g[key] > 0, key
    # The fake spends STRUCTURED_TOKEN_S per structured token and FREE_TOKEN_S per free one.
    assert s["median_tpot_ms"] >= 1000 * STRUCTURED_TOKEN_S * 0.9 and f["median_tpot_ms"] >= 1000 * FREE_TOKEN_S * 0.9
    assert res["structured_free_tpot_ratio"] == pytest.approx(s["median_tpot_ms"] / f["median_tpot_ms"])
    assert res["structured_free_tpot_ratio"] > 1.0
    for line in ("====== Structured requests (json) ======", "================ Free requests =================",
                 "{:<40} {:<10}".format("Valid outputs:", 11), "Valid output rate (%):", "Median TPOT (ms):",
                 "P50 TTFT (ms):", "P99 ITL (ms):",
                 "{:<40} {:<10.3f}".format("Structured / free median TPOT:", res["structured_free_tpot_ratio"])):
        assert line in out, line
    assert out.count("Median TPOT (ms):") == 3  # all requests, structured, free
    for path in (tmp_path / "mixed.json", tmp_path / "copy.json"):
        saved = json.loads(path.read_text())
        assert saved["structured"]["median_tpot_ms"] == s["median_tpot_ms"]
        assert saved["free"]["p99_itl_ms"] == f["p99_itl_ms"]
        assert saved["structured_free_tpot_ratio"] == res["structured_free_tpot_ratio"]
        assert saved["structured_output_ratio"] == 0.5 and saved["structured_output_kind"] == "json"


def test_free_run_has_no_split(fake, capsys):
    res = run_bench(fake, "--max-concurrency", "4")
    assert "structured" not in res and "structured_free_tpot_ratio" not in res
    assert "Structured requests" not in capsys.readouterr().out
    assert not any("structured_outputs" in p or "response_format" in p for p in fake.payloads)


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_regex_and_choice_runs(fake, kind):
    res = run_bench(fake, "--num-prompts", "16", "--max-concurrency", "8", "--structured-output-ratio", "0.25",
                    "--structured-output-kind", kind, "--structured-output-disable-any-whitespace")
    assert res["structured_flags"] == [False, False, False, True] * 4
    sent = [p["structured_outputs"] for p in fake.payloads if "structured_outputs" in p]
    assert len(sent) == 4 and all(c["disable_any_whitespace"] is True and kind in c for c in sent)
    assert res["structured"]["valid_outputs"] == 4 and res["structured"]["valid_output_rate"] == 100.0
    assert res["structured_output_kind"] == kind


def test_chat_json_uses_response_format(fake):
    res = run_bench(fake, "--backend", "openai-chat", "--max-concurrency", "4", "--structured-output-ratio", "1")
    assert res["structured"]["completed"] == 20 and res["free"]["num_requests"] == 0
    assert res["structured_free_tpot_ratio"] is None  # no free requests to compare with
    assert all(p["response_format"]["type"] == "json_schema" and p["response_format"]["json_schema"]["strict"]
               for p in fake.payloads)
    assert res["structured"]["valid_outputs"] == 18  # schema 0 (sent twice in 20) is cut short by the fake


def test_structured_flags_are_checked(fake):
    with pytest.raises(ValueError, match="structured-output-ratio"):
        run_bench(fake, "--structured-output-ratio", "-0.1")
    with pytest.raises(ValueError, match=re.escape("--structured-output-kind needs --structured-output-ratio > 0")):
        run_bench(fake, "--structured-output-kind", "regex")
    with pytest.raises(ValueError, match="disable-any-whitespace needs"):
        run_bench(fake, "--structured-output-disable-any-whitespace")
    with pytest.raises(ValueError, match="kind and --structured-output-disable-any-whitespace need"):
        run_bench(fake, "--structured-output-kind", "json", "--structured-output-disable-any-whitespace")
    assert fake.payloads == []  # rejected before any request was sent


# ----- against the real server ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_mixed_run_against_tokenmill_server(tiny_model_factory, tmp_path):
    """A random-weight tiny Llama behind `tokenmill serve`: every constrained answer obeys its schema."""
    import argparse

    from tests.entrypoints.openai.server_utils import RemoteServer
    from tokenmill.benchmarks import serve
    model = tiny_model_factory("llama")
    srv = RemoteServer([model, "--max-model-len", "512", "--disable-log-stats"], str(tmp_path / "server.log"),
                       cmd=[__import__("sys").executable, "-m", "tokenmill.entrypoints.cli.main", "serve"])
    try:
        srv.wait_healthy(120)
        parser = argparse.ArgumentParser()
        serve.add_cli_args(parser)
        res = serve.main(parser.parse_args([
            "--port", str(srv.port), "--tokenizer", model, "--num-prompts", "8", "--random-input-len", "16",
            "--random-output-len", "160", "--max-concurrency", "8", "--structured-output-ratio", "0.5",
            "--structured-output-disable-any-whitespace", "--disable-tqdm"]))
    finally:
        srv.stop()
    assert res["failed"] == 0, res["errors"]
    assert res["free"]["total_output_tokens"] == 4 * 160  # free requests ignore EOS
    assert res["structured"]["valid_output_rate"] == 100.0, res["generated_texts"]
    assert 0 < res["structured"]["total_output_tokens"] < 4 * 160
    assert res["structured_free_tpot_ratio"] > 0

"""The structured-output manager builds its compiler off the step loop (tokenizer and transformers: seconds)."""
from __future__ import annotations

import threading
import time
import types
from concurrent.futures import Future

import pytest

from tokenmill.structured.manager import StructuredOutputManager


class _FakeCompiler:
    def __init__(self) -> None:
        self.seen = []

    def submit(self, params) -> Future:
        self.seen.append(params)
        f: Future = Future()
        f.set_result(f"compiled {params}")
        return f

    def new_request_grammar(self, compiled, stop_token_ids=None):
        return compiled


def _request(params):
    sp = types.SimpleNamespace(structured_outputs=params, stopping_token_ids=[])
    return types.SimpleNamespace(sampling_params=sp, grammar=None, grammar_future=None, grammar_start=None,
                                 output_token_ids=[])


def test_submit_returns_while_the_compiler_is_built_and_every_waiting_request_gets_its_grammar():
    mgr = StructuredOutputManager(config=None)
    gate = threading.Event()
    fake = _FakeCompiler()

    def slow_build():
        gate.wait(30)
        mgr.compiler = fake
        return fake
    mgr._build_compiler = slow_build
    reqs = [_request(f"schema{i}") for i in range(3)]
    t = time.perf_counter()
    for r in reqs:
        mgr.submit(r)
    assert time.perf_counter() - t < 1.0  # nothing waited for the build
    assert [mgr.ready(r) for r in reqs] == [False, False, False]
    gate.set()
    for r in reqs:
        r.grammar_future.result(timeout=30)
    assert [mgr.ready(r) for r in reqs] == [True, True, True]
    assert [r.grammar for r in reqs] == ["compiled schema0", "compiled schema1", "compiled schema2"]
    late = _request("schema3")
    mgr.submit(late)  # built by now: straight to the compiler
    assert mgr.ready(late) and fake.seen == ["schema0", "schema1", "schema2", "schema3"]


def test_a_compiler_that_cannot_be_built_fails_each_request_with_its_reason():
    mgr = StructuredOutputManager(config=None)

    def broken():
        raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init is set).")
    mgr._build_compiler = broken
    reqs = [_request("a"), _request("b")]
    for r in reqs:
        mgr.submit(r)
    for r in reqs:
        with pytest.raises(ValueError):
            r.grammar_future.result(timeout=30)
        with pytest.raises(ValueError, match="need a tokenizer"):
            mgr.ready(r)

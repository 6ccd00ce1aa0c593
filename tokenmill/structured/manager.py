"""The engine core's side of structured outputs: compile off the step loop, advance matchers, fill the bitmask."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)


class StructuredOutputManager:
    """Owned by the scheduler. Built lazily: an engine that never sees a constrained request loads nothing.

    Contract: `submit` starts compiling a request's grammar in a worker thread; `ready` says (without blocking)
    whether the request may be scheduled and raises ValueError if its grammar failed to compile; `accept` advances
    the request's matcher with its sampled tokens; `fill_bitmask` returns one row of allowed tokens per request given.
    The first `submit` also builds the compiler (tokenizer, transformers' import, xgrammar's vocabulary tables:
    seconds) in a thread, so the step loop serves the other requests meanwhile.
    """

    def __init__(self, config) -> None:
        self.config = config
        self.compiler = None
        self._init: Future | None = None
        self._bitmask: torch.Tensor | None = None

    def _build_compiler(self):
        from tokenmill.structured.backend_xgrammar import GrammarCompiler
        from tokenmill.transformers_utils.config import get_eos_token_ids, load_generation_config
        from tokenmill.transformers_utils.tokenizer import load_tokenizer
        mc = self.config.model_config
        tok = load_tokenizer(mc)
        if tok is None:
            raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init is set).")
        eos = get_eos_token_ids(mc.hf_config, load_generation_config(mc), tok)
        self.compiler = GrammarCompiler(tok, mc.vocab_size, stop_token_ids=eos or None)
        return self.compiler

    def submit(self, request) -> None:
        params = request.sampling_params.structured_outputs
        if self.compiler is not None:
            request.grammar_future = self.compiler.submit(params)
            return
        if self._init is None:
            self._init = Future()
            threading.Thread(target=self._run_init, name="tokenmill-grammar-init", daemon=True).start()
        fut: Future = Future()

        def compile_once_built(init: Future) -> None:
            try:
                inner = init.result().submit(params)
            except BaseException as e:  # noqa: BLE001 - the compiler could not be built: the request's error
                fut.set_exception(e)
                return
            inner.add_done_callback(lambda done: _settle(fut, done))
        self._init.add_done_callback(compile_once_built)
        request.grammar_future = fut

    def _run_init(self) -> None:
        try:
            self._init.set_result(self._build_compiler())
        except BaseException as e:  # noqa: BLE001 - every request waiting on it reports it
            self._init.set_exception(e)

    def ready(self, request) -> bool:
        if request.grammar is not None:
            return True
        fut = request.grammar_future
        if not fut.done():
            return False
        exc = fut.exception()
        if exc is not None:
            raise ValueError(f"structured outputs: {exc}")
        stops = set(request.sampling_params.stopping_token_ids) or None
        request.grammar = self.compiler.new_request_grammar(fut.result(), stop_token_ids=stops)
        # Outputs produced before the matcher existed (resumed requests, or a reasoning block that has ended).
        if request.grammar_start is not None and request.output_token_ids[request.grammar_start:]:
            request.grammar.accept_tokens(request.output_token_ids[request.grammar_start:])
        return True

    def accept(self, request, token_ids: list[int]) -> None:
        if not request.grammar.accept_tokens(token_ids):
            logger.warning("Request %s produced a token its grammar does not allow.", request.request_id)

    def fill_bitmask(self, requests: list) -> torch.Tensor:
        from tokenmill.structured.backend_xgrammar import allocate_bitmask, fill_bitmasks
        n = len(requests)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = allocate_bitmask(max(n, 16), self.compiler.vocab_size)
        fill_bitmasks([r.grammar for r in requests], self._bitmask, range(n))
        return self._bitmask[:n]


def _settle(target: Future, done: Future) -> None:
    """Give `target` the outcome of `done`."""
    exc = done.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(done.result())

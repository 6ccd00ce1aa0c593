"""`best_of`: sample best_of candidates for a prompt and return the n most likely (OpenAI's legacy completions, vLLM
V0). The engine only knows n; the entry points (the OpenAI server, offline `LLM`) ask it for best_of samples and
pick here, so a request's result is chosen only once all its candidates are complete (never while streaming)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AsyncIterator

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class BestOf:
    """Keep the `n` candidates with the highest cumulative logprob (vLLM V0's ranking); drop the per-token
    logprobs the engine computed only to rank them when the caller did not ask for logprobs."""
    n: int
    strip_logprobs: bool

    def select(self, out: RequestOutput) -> RequestOutput:
        def score(o) -> float:
            return o.cumulative_logprob if o.cumulative_logprob is not None else -math.inf
        # sorted() is stable: equal scores keep the engine's order, so greedy ties are deterministic.
        kept = sorted(out.outputs, key=score, reverse=True)[:self.n]
        for i, o in enumerate(kept):
            o.index = i
            if self.strip_logprobs:
                o.logprobs, o.cumulative_logprob = None, None
        out.outputs = kept
        return out


def expand(params: SamplingParams) -> tuple[SamplingParams, BestOf | None]:
    """(the params to give the engine, the selection to apply to its final output or None). With best_of > n the
    engine samples best_of sequences with at least the chosen token's logprob (the ranking needs it)."""
    best_of = params.best_of
    if best_of is None or best_of <= params.n:
        return params, None  # best_of == n: nothing to choose (the engine's per-sample children drop it)
    engine_params = params.clone()
    engine_params.n, engine_params.best_of = best_of, None
    strip = params.logprobs is None
    if strip:
        engine_params.logprobs = 0
    return engine_params, BestOf(params.n, strip)


async def select_final(gen: AsyncIterator[RequestOutput], plan: BestOf) -> AsyncIterator[RequestOutput]:
    """`gen`'s outputs with the selection applied (the request must report only its final output)."""
    try:
        async for out in gen:
            yield plan.select(out)
    finally:
        await gen.aclose()

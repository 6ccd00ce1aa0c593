"""Logprobs in vLLM's user-facing shapes, built from the engine core's `LogprobsLists` rows.

A row holds the chosen token first, then the batch's top-K (K = the largest N any request in the batch asked for),
so each request trims the row to its own N here, in the front end, where the work is off the engine's hot loop.
"""
from __future__ import annotations

from typing import Any

from tokenmill.core.messages import LogprobsLists
from tokenmill.engine.detokenizer import backend_tokenizer_of
from tokenmill.outputs import Logprob, PromptLogprobs, SampleLogprobs
from tokenmill.sampling_params import SamplingParams


class TokenTextCache:
    """Token id -> the text of that single token (`tokenizer.decode([id])`, special tokens kept, as vLLM does).

    Memoized: top-N logprobs decode the same few thousand ids over and over, and one tokenizer's vocabulary bounds
    the cache. A token that is part of a multi-byte character decodes to U+FFFD (vLLM shows the same). Ids the
    tokenizer does not know (a model vocabulary padded past the tokenizer's) decode to "".
    """

    def __init__(self, tokenizer: Any):
        backend = backend_tokenizer_of(tokenizer)
        if backend is not None:
            self._decode = lambda tid: backend.decode([tid], skip_special_tokens=False)
        else:
            self._decode = lambda tid: tokenizer.decode([tid], skip_special_tokens=False)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            try:
                text = self._decode(token_id) or ""
            except (IndexError, KeyError, ValueError, TypeError, OverflowError):
                text = ""
            self._cache[token_id] = text
        return text


def make_logprob_dicts(lists: LogprobsLists, num_logprobs: int,
                       token_text: TokenTextCache | None) -> list[dict[int, Logprob]]:
    """One dict per row: the chosen token first (with its given rank), then the top `num_logprobs` tokens
    (ranks 1..N); num_logprobs=-1 keeps the whole row. When the chosen token is also among the top-N it appears
    once, in first place. decoded_token is None when `token_text` is None (detokenize off)."""
    out: list[dict[int, Logprob]] = []
    for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        end = len(ids) if num_logprobs < 0 else min(1 + num_logprobs, len(ids))
        chosen = ids[0]
        row = {chosen: Logprob(lps[0], rank, token_text(chosen) if token_text is not None else None)}
        for j in range(1, end):
            tid = ids[j]
            if tid not in row:
                row[tid] = Logprob(lps[j], j, token_text(tid) if token_text is not None else None)
        out.append(row)
    return out


class LogprobsProcessor:
    """Sample and prompt logprobs of one sequence, accumulated across steps.

    Contract: `logprobs` is None unless the request asked for logprobs, else one dict per generated token;
    `cumulative_logprob` is the sum of the chosen tokens' logprobs (None when logprobs were not requested, like
    vLLM). `prompt_logprobs` is None unless prompt_logprobs was requested, else [None, dict per prompt token 1..],
    grown chunk by chunk as prefill proceeds.
    """

    __slots__ = ("num_logprobs", "num_prompt_logprobs", "logprobs", "prompt_logprobs", "cumulative_logprob",
                 "_token_text")

    def __init__(self, params: SamplingParams, token_text: TokenTextCache | None):
        self.num_logprobs = params.logprobs
        self.num_prompt_logprobs = params.prompt_logprobs
        self._token_text = token_text if params.detokenize else None
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # [None] from the start (as vLLM): a one-token prompt has no scored position, yet asked for prompt logprobs
        # it still reports the first token's None.
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None

    def update_sample(self, lists: LogprobsLists | None) -> None:
        if lists is None or self.logprobs is None:
            return
        self.logprobs.extend(make_logprob_dicts(lists, self.num_logprobs, self._token_text))
        self.cumulative_logprob += sum(row[0] for row in lists.logprobs)

    def update_prompt(self, lists: LogprobsLists | None) -> None:
        if lists is None or self.prompt_logprobs is None:
            return
        self.prompt_logprobs.extend(make_logprob_dicts(lists, self.num_prompt_logprobs, self._token_text))

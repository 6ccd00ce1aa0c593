"""Logprobs in vLLM's user-facing shapes, built from the engine core's `LogprobsLists` rows.

A row holds the chosen token first, then the batch's top-K (K = the largest N any request in the batch asked for),
so each request trims the row to its own N here, in the front end, where the work is off the engine's hot loop.
"""
from __future__ import annotations

import json
import re
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


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character a byte-level BPE vocabulary writes for each
    byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(state: Any) -> set[str]:
    """The decoder types in a `tokenizers` decoder's JSON state (a Sequence's members included)."""
    if isinstance(state, dict):
        found = {state["type"]} if isinstance(state.get("type"), str) else set()
        for member in state.get("decoders") or []:
            found |= _decoder_types(member)
        return found
    return set()


class TokenBytes:
    """Token id -> the token's own UTF-8 bytes: the `bytes` of chat logprobs, which OpenAI defines so that the
    pieces of a character split across tokens concatenate to it.

    A token whose text (`decode([id])`) is whole is that text's bytes. One that holds only part of a character
    decodes to U+FFFD (so vLLM reports the bytes of U+FFFD, EF BF BD, for every such piece); its real bytes come
    from the vocabulary entry: a `<0xE4>` byte-fallback token is that byte, a byte-level BPE entry maps back
    through the byte-level alphabet. Anything else keeps the bytes of its text. Memoized like TokenTextCache.
    """

    def __init__(self, tokenizer: Any):
        backend = backend_tokenizer_of(tokenizer)
        self._byte_level: dict[str, int] | None = None
        if backend is not None:
            self._id_to_token = backend.id_to_token
            try:
                types = _decoder_types(json.loads(backend.decoder.__getstate__()))
            except (AttributeError, TypeError, ValueError):
                types = set()
            if "ByteLevel" in types:
                self._byte_level = _byte_level_chars()
        else:
            convert = getattr(tokenizer, "convert_ids_to_tokens", None)
            self._id_to_token = convert if convert is not None else (lambda tid: None)
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._raw(token_id) or list(text.encode("utf-8"))
        return cached

    def _raw(self, token_id: int) -> list[int] | None:
        try:
            piece = self._id_to_token(token_id)
        except (IndexError, KeyError, ValueError, TypeError, OverflowError):
            return None
        if not isinstance(piece, str) or not piece:
            return None
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None:
            return [int(m.group(1), 16)]
        if self._byte_level is not None:
            try:
                return [self._byte_level[c] for c in piece]
            except KeyError:
                return None
        return None


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

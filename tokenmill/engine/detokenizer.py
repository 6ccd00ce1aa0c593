"""Incremental detokenization and stop-string detection for one generated sequence.

Runs in the front end (the API-server process in serving, in-process for offline `LLM`), once per sequence per
engine step, so the per-token work is a small constant: each new token costs at most two decodes of a short window
of ids (measured ~1.1 us/token with the SmolLM2 tokenizer; `tokenizers.decoders.DecodeStream` measured ~0.7 us but
hides its pending bytes, which we need to flush at the end and to run on tokenizers without a Rust backend).
"""
from __future__ import annotations

from typing import Any, Callable

from tokenmill.sampling_params import SamplingParams

# How many prompt tokens seed the decode window, so the first generated token decodes the way it would inside the
# full text (sentencepiece-style decoders drop the leading space of the first token of a decode call).
_PROMPT_CONTEXT_TOKENS = 5
# Drop consumed ids from the window's list once this many have piled up (keeps memory bounded, O(1) amortized).
_WINDOW_TRIM = 64
# Merge this many small text chunks into one (bounds the per-token object overhead of very long outputs).
_CHUNK_MERGE = 256
_REPLACEMENT = "\ufffd"


def backend_tokenizer_of(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind an HF tokenizer (or the tokenizer itself), else None."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


def make_decode_fn(tokenizer: Any, skip_special_tokens: bool,
                   spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text with the request's special-token settings.

    Fast tokenizers go straight to the Rust decoder (what HF's `decode` does for them, minus Python overhead and
    minus `clean_up_tokenization_spaces`, which vLLM's incremental detokenizer does not apply either). Other
    tokenizers use their own `decode`, which knows `spaces_between_special_tokens`.
    """
    backend = backend_tokenizer_of(tokenizer)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens,
                                        clean_up_tokenization_spaces=False)


class DecodeWindow:
    """Turns ids into text one token at a time by decoding a short sliding window.

    Contract: the concatenation of everything `step` and `flush` return equals `decode(ids fed)` for tokenizers
    whose decoded text of a token run is a prefix of the decoded text of a longer run (byte-level BPE,
    sentencepiece, WordPiece), context aside: a character that the context's last tokens begin and the fed ids
    complete is returned whole. Text is `decode(ids[prefix:])` minus the already-returned
    `decode(ids[prefix:read])`; while the window's text ends in U+FFFD the last token stopped inside a multi-byte
    character, so nothing is returned until a later token completes it (or `flush` gives up at the end).
    """

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_prefix_text", "_held_context")

    def __init__(self, decode: Callable[[list[int]], str], context_ids: list[int]):
        self._decode = decode
        context = list(context_ids[-_PROMPT_CONTEXT_TOKENS:])
        text = decode(context) if context else ""
        held = 0  # the context's last ids that begin a character: held back as if fed, until the output ends it
        if text.endswith(_REPLACEMENT):
            cut = _before_incomplete_character(decode, context, text)
            if cut is None:
                # The prompt ends in bytes that are not the start of one character: decode the output on its own,
                # as decode(output_ids) would.
                context, text = [], ""
            else:
                text, held = cut
        self._ids = context
        self._prefix = 0
        self._read = len(context) - held
        self._prefix_text = text
        self._held_context = held

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""  # nothing new yet (skipped special token) or an incomplete character: hold back
        return self._advance(text)

    def pending(self) -> str:
        """The text held back now, up to the incomplete character it ends in (one more decode)."""
        text = self._decode(self._ids[self._prefix:])
        return text[len(self._prefix_text):].rstrip(_REPLACEMENT)

    def flush(self) -> str:
        """Returns whatever is held back (a trailing incomplete character decodes to U+FFFD, like `decode`)."""
        if len(self._ids) - self._read <= self._held_context:
            return ""  # nothing fed since the last text (the prompt's own bytes are not the output's)
        text = self._decode(self._ids[self._prefix:])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._held_context = 0
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if self._prefix >= _WINDOW_TRIM:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return new_text


def _before_incomplete_character(decode: Callable[[list[int]], str], context: list[int],
                                 text: str) -> tuple[str, int] | None:
    """The prompt's context ends inside a character (`text`, its decoding, ends in U+FFFD): the text before that
    character and how many of the last ids hold its first bytes (at most 3: a character has at most 4 bytes), or
    None when no such split exists (the tail is not a character's start).

    A prompt given as token ids can end mid-character, e.g. a continuation of an output that max_tokens cut inside
    a character. The output's first tokens then complete that character, and the whole character is the output's
    text (as in vLLM), not a U+FFFD for the output's bytes of it. The text before it is what the ids before the
    character's first bytes decode to, plus the text the first of those ids holds before them (a byte-level
    "ĠÐ" token is a space and the first byte of a Cyrillic letter); byte fallback decodes a run of <0xNN> pieces
    that is not valid UTF-8 as one U+FFFD per piece, so there only the ids before the character's count."""
    for j in range(1, min(3, len(context)) + 1):
        head = decode(context[:-j])
        if not head.endswith(_REPLACEMENT):
            if text.startswith(head):
                head = text.rstrip(_REPLACEMENT)
            return head, j
    return None


class IncrementalDetokenizer:
    """Text of one generated sequence, built token by token, with stop strings applied.

    Contract:
    - `update(new_token_ids)` appends the ids to `token_ids`, extends the text and returns the stop string that
      ended the sequence (or None). On a hit the text is cut before the stop string (after it with
      include_stop_str_in_output) and everything after it is dropped; the ids are kept as generated. Call no more
      after a hit.
    - `update(..., stop_terminated=True)` (the engine stopped on EOS / a stop token id): the last id is kept in
      `token_ids` but not detokenized unless include_stop_str_in_output, as vLLM does.
    - `update(..., final=True)` (the engine finished the sequence): a trailing incomplete character is flushed as
      U+FFFD so the final text equals `tokenizer.decode(token_ids)`. Otherwise U+FFFD never appears for valid text.
    - Final text == `tokenizer.decode(token_ids, skip_special_tokens=...)` (minus a stop-token-terminated last
      token, and cut at a stop string), except that the prompt's last tokens seed the decoder, so a
      sentencepiece-style first token keeps its leading space like it does inside prompt + output (vLLM does the
      same); byte-level BPE is unaffected. A prompt (given as ids) that ends inside a character has it completed
      by the output: that character, whole, starts the text (vLLM does the same), not a U+FFFD for the output's
      bytes of it. `clean_up_tokenization_spaces` is not applied (as in vLLM).
    - `get_next_output_text(finished, delta)` is what may be shown to a client now: while a stop string could
      still be forming it holds back the last (longest stop string - 1) characters unless finished.
    - With detokenize=False or no tokenizer the text stays "" and only ids are tracked.
    Per-token work is O(1) amortized: a small decode window, and the stop search only scans the new text plus a
    look-back of (longest stop string - 1) characters.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int] | None, params: SamplingParams):
        self.token_ids: list[int] = []
        self._stop: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._window: DecodeWindow | None = None
        self._added_tokens: dict[int, str] | None = None
        self._last_was_added = False
        if tokenizer is not None and params.detokenize:
            skip = params.skip_special_tokens
            self._window = DecodeWindow(
                make_decode_fn(tokenizer, skip, params.spaces_between_special_tokens), prompt_token_ids or [])
            # vLLM: with special tokens shown and spaces_between_special_tokens=False, a special token that follows
            # another one is emitted as its raw text, so a decoder that joins tokens with spaces cannot add one.
            if not skip and not params.spaces_between_special_tokens:
                self._added_tokens = _added_tokens_of(tokenizer)
        elif self._stop:
            raise ValueError("stop strings need a tokenizer and detokenize=True")
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # Characters a streaming client must not see yet: they could be the start of a stop string.
        self._stop_buffer = self._max_stop_len - 1 if self._stop and not self._include_stop else 0
        self._chunks: list[str] = []  # the text, as appended pieces (joined lazily: no O(len) copy per token)
        self._num_chars = 0
        self._joined: str | None = ""
        self._delta_offset = 0  # characters already handed out by get_next_output_text(delta=True)
        self.stop_string: str | None = None

    # ----- updates -----
    def update(self, new_token_ids: list[int], stop_terminated: bool = False, final: bool = False) -> str | None:
        """Appends ids, extends the text, returns the matched stop string or None (see the class contract)."""
        if not new_token_ids and not final:
            return None
        window = self._window
        if window is None:
            self.token_ids.extend(new_token_ids)
            return None
        decode_ids = new_token_ids
        if stop_terminated and not self._include_stop and new_token_ids:
            decode_ids = new_token_ids[:-1]
        chars_before = self._num_chars
        # Text appended while fewer than min_tokens exist is not searched for stop strings (vLLM does the same).
        search_from = chars_before
        pieces: list[str] = []
        for token_id in decode_ids:
            self.token_ids.append(token_id)
            piece = window.step(token_id)
            if self._added_tokens is not None:
                piece = self._raw_special(token_id, piece)
            if piece:
                pieces.append(piece)
                if len(self.token_ids) <= self._min_tokens:
                    search_from += len(piece)
        if len(decode_ids) != len(new_token_ids):
            self.token_ids.append(new_token_ids[-1])
        if final:
            pieces.append(window.flush())
        new_text = "".join(pieces)
        if new_text:
            self._append(new_text)
        if not self._stop or len(self.token_ids) <= self._min_tokens or self._num_chars == search_from:
            return None
        return self._check_stop(search_from)

    def _raw_special(self, token_id: int, piece: str) -> str:
        raw = self._added_tokens.get(token_id)
        if raw is not None and self._last_was_added:
            piece = raw
        self._last_was_added = raw is not None
        return piece

    def _append(self, text: str) -> None:
        self._chunks.append(text)
        self._num_chars += len(text)
        self._joined = None
        if len(self._chunks) >= 2 * _CHUNK_MERGE:
            self._chunks[-_CHUNK_MERGE:] = ["".join(self._chunks[-_CHUNK_MERGE:])]

    def _check_stop(self, search_from: int) -> str | None:
        """Looks for stop strings that end after `search_from` (text before it was searched already, or was
        produced under min_tokens). The stop string that completes first wins (earliest end, then earliest start),
        which is what feeding one token at a time would give, so the result does not depend on step sizes."""
        start = max(search_from - (self._max_stop_len - 1), 0)
        window = self._suffix(self._num_chars - start)
        new_from = search_from - start  # where the unsearched text begins inside `window`
        best_key, best_pos, best = None, -1, None
        for stop in self._stop:
            pos = window.find(stop, max(new_from - len(stop) + 1, 0))
            if pos != -1 and (best_key is None or (pos + len(stop), pos) < best_key):
                best_key, best_pos, best = (pos + len(stop), pos), pos, stop
        if best is None:
            return None
        cut = start + best_pos + (len(best) if self._include_stop else 0)
        if cut < self._num_chars:
            text = self.output_text[:cut]
            self._chunks, self._num_chars, self._joined = [text], len(text), text
            # Never past the cut: the stop buffer kept any possible stop-string start from being handed out.
            self._delta_offset = min(self._delta_offset, cut)
        self.stop_string = best
        return best

    # ----- reading -----
    @property
    def output_text(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._chunks)
            self._chunks = [self._joined] if self._joined else []
        return self._joined

    def _suffix(self, n: int) -> str:
        """The last n characters, touching only the chunks that hold them."""
        if n <= 0:
            return ""
        parts, need = [], n
        for chunk in reversed(self._chunks):
            if len(chunk) >= need:
                parts.append(chunk[len(chunk) - need:])
                break
            parts.append(chunk)
            need -= len(chunk)
        return "".join(reversed(parts))

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (delta=False) or what is new since the last delta call (delta=True),
        minus the characters that could still become a stop string unless finished."""
        buffer = 0 if finished else self._stop_buffer
        end = max(self._num_chars - buffer, 0)
        if not delta:
            return self.output_text[:end] if buffer else self.output_text
        if end <= self._delta_offset:
            return ""
        text = self._suffix(self._num_chars - self._delta_offset)[:end - self._delta_offset]
        self._delta_offset = end
        return text


def _added_tokens_of(tokenizer: Any) -> dict[int, str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder is None:
        backend = backend_tokenizer_of(tokenizer)
        decoder = backend.get_added_tokens_decoder() if backend is not None else {}
    return {tid: getattr(tok, "content", str(tok)) for tid, tok in decoder.items()}

"""POST /v1/completions: prompts as text, token ids or batches of either; streaming and one-shot responses."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from tokenmill.engine.detokenizer import DecodeWindow, make_decode_fn
from tokenmill.engine.protocol import EngineDeadError
from tokenmill.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                   CompletionResponseChoice, CompletionResponseStreamChoice,
                                                   CompletionStreamResponse)
from tokenmill.entrypoints.openai.serving_engine import (OpenAIServing, Primed, ServingError, SSEStream,
                                                         merge_async_iterators, prime_all, sse_error_event)
from tokenmill.outputs import Logprob, RequestOutput

Prompt = tuple[Optional[str], list[int]]  # (text, or None for token-id prompts; token ids)


class TextOffsets:
    """`text_offset` of one choice: where each token's text starts in the choice's returned text, token by token
    across stream chunks.

    The tokens are decoded as the output was (a window seeded with the prompt's last tokens, the request's special
    token settings), so each offset is where that token's own text starts, and the byte pieces of a multi-byte
    character (byte-level BPE pieces of a CJK character or an emoji, `<0xE4>` byte-fallback tokens) point at that
    character, instead of moving the offsets on by the length of each piece's lone "\ufffd" (which left later
    offsets past their tokens, and streamed offsets out of order). With echo the prompt's tokens come first, at
    offsets into the prompt text.
    """

    def __init__(self, tokenizer: Any, request: CompletionRequest, prompt: Prompt, prompt_text_len: int | None):
        self._tokenizer = tokenizer
        self._request = request
        self._prompt_ids = prompt[1]
        self._pos = 0
        self._held = 0  # characters decoded but held back in the window (they precede an incomplete character)
        self._echo_len = prompt_text_len  # None: no echo; else the echoed prompt's length (its tokens come first)
        self._window: DecodeWindow | None = None

    def _walk(self, window: DecodeWindow, ids: list[int], limit: int | None) -> list[int]:
        out = []
        for tid in ids:
            at = self._pos + self._held
            out.append(at if limit is None else min(at, limit))
            piece = window.step(tid)
            self._pos += len(piece)
            # Text before an incomplete character is held back with it; the next token starts after that text.
            self._held = 0 if piece else len(window.pending())
        return out

    def prompt(self) -> list[int]:
        """Offsets of the echoed prompt's tokens (the prompt text is the prompt as given, special tokens and all)."""
        if self._tokenizer is None or self._echo_len is None:
            return [0] * len(self._prompt_ids)
        window = DecodeWindow(make_decode_fn(self._tokenizer, False, True), [])
        offsets = self._walk(window, self._prompt_ids, self._echo_len)
        self._pos, self._held = self._echo_len, 0
        return offsets

    def generated(self, ids: list[int], text_len: int | None = None) -> list[int]:
        """Offsets of the next generated tokens (after `prompt()` with echo); `text_len` (the choice's whole text,
        once known) caps them, for tokens whose text a stop string cut off."""
        if self._tokenizer is None:
            return [self._pos] * len(ids)
        if self._window is None:
            r = self._request
            self._window = DecodeWindow(
                make_decode_fn(self._tokenizer, r.skip_special_tokens, r.spaces_between_special_tokens),
                self._prompt_ids)
        return self._walk(self._window, ids, text_len)


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, request: CompletionRequest,
                                raw_request: Any = None) -> CompletionResponse | SSEStream:
        self.check_model(request.model)
        self.check_supported(request)
        # echo with max_tokens 0 returns only the prompt (and its logprobs): how clients score a text, as in vLLM.
        echo_only = request.echo and request.max_tokens == 0
        if request.max_tokens is not None and request.max_tokens < 1 and not echo_only:
            raise ServingError(f"max_tokens must be at least 1, got {request.max_tokens}"
                               " (0 is allowed only with echo).", 400, "max_tokens")
        self.check_logprobs("logprobs", request.logprobs)
        self.check_logprobs("prompt_logprobs", request.prompt_logprobs)
        response_id, base_id = self.request_ids(raw_request, request.request_id, "cmpl-")
        prompts = await self._prompts(request)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs  # echoed prompt tokens get their logprobs too
        # The engine always samples one token; an echo-only request drops it from the response.
        max_tokens = 1 if echo_only else request.max_tokens
        gens = []
        for i, (text, ids) in enumerate(prompts):
            self.check_length(len(ids), max_tokens, input_param="prompt")
            params = self.sampling_params(request, len(ids), max_tokens, request.logprobs, prompt_logprobs,
                                          request.stream)
            engine_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            beam = self.beam_params(request, params)
            lora = self.models.lora_for(request.model)
            if beam is not None and lora is not None:
                raise ServingError("use_beam_search under a LoRA adapter is not supported yet.", 400, "model")
            if beam is not None:
                gens.append(self.start_beam(engine_id, text, ids, beam, request.priority, request.cache_salt,
                                            params.skip_special_tokens))
                continue
            gens.append(self.start(engine_id, text, ids, params, request.priority, request.cache_salt, lora))
        created = int(time.time())
        if request.stream:
            streams = await prime_all(gens)
            body = self._stream(request, response_id, created, prompts, streams)
            return SSEStream(body, streams)
        finals: list[RequestOutput | None] = [None] * len(gens)
        async for i, res in merge_async_iterators(*gens):
            finals[i] = res
        return self._response(request, response_id, created, prompts, finals)

    # ----- prompts -----
    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        p = request.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif len(p) == 0:
            raise ServingError("prompt must not be empty.", 400, "prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        out: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                ids = await self.tokenize_async(item, request.add_special_tokens)
                text: str | None = item
            else:
                ids = list(item)
                self.check_token_ids(ids)
                text = None
            kept = self.truncate(ids, request.truncate_prompt_tokens, self.max_model_len)
            if len(kept) < len(ids):
                # The model sees only the kept tokens: echo (and its logprobs' tokens and offsets) shows those.
                ids, text = kept, None
            if not ids:
                raise ServingError("The prompt is empty; give at least one token.", 400, "prompt")
            out.append((text, ids))
        return out

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt[0] if prompt[0] is not None else self.decode(prompt[1])

    # ----- logprobs -----
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None] | None,
                            num: int, offsets: list[int], as_ids: bool) -> CompletionLogProbs:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (the chosen token plus the top `num`, as
        token text -> logprob) and text_offset (where each token starts in the returned text: `offsets`, from
        TextOffsets)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for i, tid in enumerate(token_ids):
            step = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            if step is None:
                token = self.token_str(tid, None, as_ids)
                token_logprobs.append(None)
                top.append(None)
            else:
                chosen = step.get(tid)
                token = self.token_str(tid, chosen, as_ids)
                token_logprobs.append(max(chosen.logprob, -9999.0) if chosen is not None else None)
                top.append({self.token_str(t, lp, as_ids): max(lp.logprob, -9999.0)
                            for j, (t, lp) in enumerate(step.items()) if num < 0 or j <= num})
            tokens.append(token)
        return CompletionLogProbs(text_offset=list(offsets), token_logprobs=token_logprobs, tokens=tokens,
                                  top_logprobs=top)

    # ----- one-shot -----
    def _response(self, request: CompletionRequest, response_id: str, created: int, prompts: list[Prompt],
                  finals: list[RequestOutput | None]) -> CompletionResponse:
        as_ids = self.return_as_ids(request)
        choices: list[CompletionResponseChoice] = []
        prompt_tokens = completion_tokens = cached = 0
        for pi, res in enumerate(finals):
            if res is None:
                raise EngineDeadError("the engine returned no output for a request")
            pids = prompts[pi][1]
            prompt_tokens += len(pids)
            cached += res.num_cached_tokens or 0
            for out in res.outputs:
                text, ids, lps = out.text, list(out.token_ids), out.logprobs
                if request.max_tokens == 0:  # echo only
                    text, ids, lps = "", [], []
                completion_tokens += len(ids)
                offsets: list[int] = []
                if request.echo:
                    prompt_text = self._prompt_text(prompts[pi])
                    text = prompt_text + text
                    if request.logprobs is not None:
                        where = TextOffsets(self.tokenizer, request, prompts[pi], len(prompt_text))
                        offsets = where.prompt() + where.generated(ids, len(text))
                        ids = pids + ids
                        lps = list(res.prompt_logprobs or [None] * len(pids)) + list(lps or [])
                elif request.logprobs is not None:
                    offsets = TextOffsets(self.tokenizer, request, prompts[pi], None).generated(ids, len(text))
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(ids, lps, request.logprobs, offsets, as_ids)
                choice = CompletionResponseChoice(index=pi * request.n + out.index, text=text, logprobs=logprobs,
                                                  finish_reason=out.finish_reason, stop_reason=out.stop_reason)
                if request.prompt_logprobs is not None:
                    choice.prompt_logprobs = self.prompt_logprobs_json(res)
                if request.return_token_ids:
                    choice.prompt_token_ids, choice.token_ids = pids, [] if request.max_tokens == 0 else list(
                        out.token_ids)
                choices.append(choice)
        choices.sort(key=lambda c: c.index)
        self.log_output(response_id, [c.text for c in choices])
        return CompletionResponse(id=response_id, created=created, model=self.models.response_name(request.model),
                                  choices=choices,
                                  usage=self.usage(prompt_tokens, completion_tokens, cached),
                                  system_fingerprint=self.fingerprint)

    # ----- streaming -----
    async def _stream(self, request: CompletionRequest, response_id: str, created: int, prompts: list[Prompt],
                      streams: list[Primed]) -> AsyncIterator[str]:
        n = request.n
        model = self.models.response_name(request.model)
        num_choices = n * len(prompts)
        echoed = [False] * num_choices
        text_len = [0] * num_choices
        tokens_out = [0] * num_choices
        cached = [0] * len(prompts)
        prompt_lps: list[Any] = [None] * len(prompts)
        include_usage, continuous = self.usage_flags(request)
        as_ids = self.return_as_ids(request)
        texts = [""] * num_choices
        where: list[TextOffsets | None] = [None] * num_choices
        try:
            async for pi, res in merge_async_iterators(*streams):
                pids = prompts[pi][1]
                if res.num_cached_tokens:
                    cached[pi] = res.num_cached_tokens
                if res.prompt_logprobs is not None:
                    prompt_lps[pi] = res.prompt_logprobs
                for out in res.outputs:
                    i = pi * n + out.index
                    delta_text, ids, lps = out.text, list(out.token_ids), out.logprobs
                    if request.max_tokens == 0:  # echo only
                        delta_text, ids, lps = "", [], []
                    new_ids = ids
                    first = not echoed[i]
                    offsets: list[int] = []
                    if first and request.logprobs is not None:
                        prompt_text_len = len(self._prompt_text(prompts[pi])) if request.echo else None
                        where[i] = TextOffsets(self.tokenizer, request, prompts[pi], prompt_text_len)
                    if request.echo and first:
                        delta_text = self._prompt_text(prompts[pi]) + delta_text
                        if request.logprobs is not None:
                            offsets = where[i].prompt()
                            ids = pids + ids
                            lps = list(prompt_lps[pi] or [None] * len(pids)) + list(lps or [])
                    echoed[i] = True
                    if not delta_text and not new_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        total = text_len[i] + len(delta_text) if out.finish_reason is not None else None
                        offsets += where[i].generated(new_ids, total)
                        logprobs = self.completion_logprobs(ids, lps, request.logprobs, offsets, as_ids)
                    text_len[i] += len(delta_text)
                    tokens_out[i] += len(new_ids)
                    texts[i] += delta_text
                    choice = CompletionResponseStreamChoice(index=i, text=delta_text, logprobs=logprobs,
                                                            finish_reason=out.finish_reason,
                                                            stop_reason=out.stop_reason)
                    if request.return_token_ids:
                        if first:
                            choice.prompt_token_ids = pids
                        choice.token_ids = list(new_ids)
                    chunk = CompletionStreamResponse(id=response_id, object="text_completion", created=created,
                                                     model=model, choices=[choice],
                                                     system_fingerprint=self.fingerprint)
                    self.set_chunk_usage(chunk, include_usage, continuous, len(pids), tokens_out[i], cached[pi])
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            if include_usage:
                usage = self.usage(sum(len(p[1]) for p in prompts), sum(tokens_out), sum(cached))
                chunk = CompletionStreamResponse(id=response_id, object="text_completion", created=created,
                                                 model=model, choices=[], usage=usage,
                                                 system_fingerprint=self.fingerprint)
                yield f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
            self.log_output(response_id, texts)
        except Exception as e:  # as vLLM: any failure ends the stream with an error event, not a cut body
            yield sse_error_event(e)
        yield "data: [DONE]\n\n"

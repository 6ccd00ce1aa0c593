"""POST /v1/completions: prompts as text, token ids or batches of either; streaming and one-shot responses."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from tokenmill.engine.protocol import EngineDeadError
from tokenmill.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                   CompletionResponseChoice, CompletionResponseStreamChoice,
                                                   CompletionStreamResponse)
from tokenmill.entrypoints.openai.serving_engine import (OpenAIServing, Primed, ServingError, SSEStream,
                                                         merge_async_iterators, prime_all, sse_error_event)
from tokenmill.outputs import Logprob, RequestOutput

Prompt = tuple[Optional[str], list[int]]  # (text, or None for token-id prompts; token ids)


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
            ids = self.truncate(ids, request.truncate_prompt_tokens, self.max_model_len)
            if not ids:
                raise ServingError("The prompt is empty; give at least one token.", 400, "prompt")
            out.append((text, ids))
        return out

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt[0] if prompt[0] is not None else self.decode(prompt[1])

    # ----- logprobs -----
    def completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None] | None,
                            num: int, initial_offset: int, as_ids: bool) -> CompletionLogProbs:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs (the chosen token plus the top `num`, as
        token text -> logprob) and text_offset (where each token starts in the returned text)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        last_len = 0
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
            offsets.append(initial_offset if not offsets else offsets[-1] + last_len)
            last_len = len(token)
        return CompletionLogProbs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens,
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
                if request.echo:
                    text = self._prompt_text(prompts[pi]) + text
                    if request.logprobs is not None:
                        ids = pids + ids
                        lps = list(res.prompt_logprobs or [None] * len(pids)) + list(lps or [])
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(ids, lps, request.logprobs, 0, as_ids)
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
                    if request.echo and first:
                        delta_text = self._prompt_text(prompts[pi]) + delta_text
                        if request.logprobs is not None:
                            ids = pids + ids
                            lps = list(prompt_lps[pi] or [None] * len(pids)) + list(lps or [])
                    echoed[i] = True
                    if not delta_text and not new_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self.completion_logprobs(ids, lps, request.logprobs, text_len[i], as_ids)
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
        except (EngineDeadError, ServingError, ValueError, TypeError) as e:
            yield sse_error_event(e)
        yield "data: [DONE]\n\n"

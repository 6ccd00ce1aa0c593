"""POST /v1/chat/completions: conversations rendered through the chat template, streaming and one-shot."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from tokenmill.config.frontend import FrontendConfig
from tokenmill.engine.protocol import EngineClient, EngineDeadError
from tokenmill.entrypoints.chat_utils import load_chat_template, message_text, render_chat
from tokenmill.entrypoints.openai.chat_parsing import ChatParsing, RequestParsing
from tokenmill.entrypoints.openai.protocol import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                   ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                   ChatCompletionResponse, ChatCompletionResponseChoice,
                                                   ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                   ChatMessage, DeltaMessage)
from tokenmill.entrypoints.openai.serving_engine import (OpenAIServing, Primed, RequestTracker, ServingError,
                                                         SSEStream, prime_all, sse_error_event)
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.logger import init_logger
from tokenmill.outputs import Logprob, RequestOutput

logger = init_logger(__name__)


class ChatRenderer:
    """The chat-template settings of this server (--chat-template, content format, default kwargs, trust), shared
    by /v1/chat/completions and /tokenize."""

    def __init__(self, tokenizer: Any, frontend: FrontendConfig) -> None:
        self.tokenizer = tokenizer
        self.frontend = frontend
        self.chat_template = load_chat_template(frontend.chat_template)  # a bad path fails at start-up

    def render(self, messages: list[dict[str, Any]], *, request_template: str | None, add_generation_prompt: bool,
               continue_final_message: bool, tools: list[dict] | None, request_kwargs: dict[str, Any] | None,
               documents: list[dict] | None = None) -> str:
        if request_template is not None and not self.frontend.trust_request_chat_template:
            raise ServingError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                               "Refused request with untrusted chat template.", 400, "chat_template")
        kwargs = dict(self.frontend.default_chat_template_kwargs or {})
        kwargs.update(request_kwargs or {})
        if documents is not None:
            if not self.reads_variable("documents", request_template):
                raise ServingError("documents cannot be honoured: this model's chat template has no documents "
                                   "variable, so they would not reach the model (put them in a message instead).",
                                   400, "documents")
            kwargs["documents"] = documents
        if any(isinstance(m, dict) and m.get("role") == "developer" for m in messages) \
                and not self.reads_variable("developer", request_template):
            # OpenAI's newer name for the system prompt (Codex, the Agents SDK and reasoning-model clients send it).
            # A template without the role would render a role the model never saw, or drop or refuse it; the
            # Responses route renders it as "system" too, so one conversation gets one prompt on either route.
            messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                        for m in messages]
        try:
            return render_chat(self.tokenizer, messages, chat_template=request_template or self.chat_template,
                               content_format=self.frontend.chat_template_content_format,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, tools=tools,
                               chat_template_kwargs=kwargs)
        except (ValueError, TypeError) as e:
            raise ServingError(str(e), 400, "messages") from None

    def reads_variable(self, name: str, request_template: str | None) -> bool:
        """Whether the chat template in use mentions the template variable `name` (a template that never reads
        it would drop it: a request field passed that way must then be refused, not ignored)."""
        template = request_template or self.chat_template or getattr(self.tokenizer, "chat_template", None)
        return name in str(template or "")


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, frontend: FrontendConfig,
                 tracker: RequestTracker | None = None, renderer: ChatRenderer | None = None) -> None:
        super().__init__(engine, models, frontend, tracker)
        self.renderer = renderer or ChatRenderer(self.tokenizer, frontend)
        self.response_role = frontend.response_role
        self.parsing = ChatParsing(self.tokenizer, frontend)
        if self.parsing.tools is not None and self.tokenizer is not None \
                and not self.renderer.reads_variable("tools", None):
            # Not a request error (the tools still shape "required" / named calls, and a template may be
            # passed per request), but "auto" then offers the model tools it is never shown.
            logger.warning("--enable-auto-tool-choice is set, but the chat template never reads `tools`: the tool "
                           "definitions of a request will not reach the model, so tool_choice \"auto\" gets calls only "
                           "if the model makes them unprompted. Pass a --chat-template that renders tools.")

    @staticmethod
    def _named_choice(parsing: RequestParsing) -> bool:
        return parsing.forced is not None and parsing.forced[1] is not None

    def request_role(self, request: ChatCompletionRequest) -> str:
        if request.add_generation_prompt:
            return self.response_role
        return str(request.messages[-1].get("role", self.response_role))

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Any = None) -> ChatCompletionResponse | SSEStream:
        self.check_model(request.model)
        self.check_supported(request)
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        if requested is not None and requested < 1:
            raise ServingError(f"{param} must be at least 1, got {requested}.", 400, param)
        logprobs = None
        if request.logprobs:
            logprobs = request.top_logprobs or 0
            self.check_logprobs("top_logprobs", logprobs)
        self.check_logprobs("prompt_logprobs", request.prompt_logprobs)
        response_id, engine_id = self.request_ids(raw_request, request.request_id, "chatcmpl-")
        tools = request.tools
        if request.tool_choice == "none" and self.frontend.exclude_tools_when_tool_choice_none:
            tools = None
        if request.tool_choice == "auto" and self.parsing.tools is None:
            why = "`tools` were given without `tool_choice`, which then defaults to \"auto\". " \
                if request._tool_choice_defaulted else ""
            raise ServingError(f'{why}"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                               'to be set (or send tool_choice "none", "required" or a named function).', 400,
                               "tool_choice")
        if self.tokenizer is None:
            raise ServingError("Chat needs a tokenizer, but this server was started with skip_tokenizer_init.", 400)
        if request.reasoning_effort is not None and not self.renderer.reads_variable("reasoning_effort",
                                                                                   request.chat_template):
            raise ServingError(f"reasoning_effort={request.reasoning_effort!r} cannot be honoured: this model's chat "
                               "template has no reasoning_effort variable (its reasoning, if any, is set through "
                               "chat_template_kwargs, e.g. enable_thinking).", 400, "reasoning_effort")
        prompt = self.renderer.render(request.messages, request_template=request.chat_template,
                                      add_generation_prompt=request.add_generation_prompt,
                                      continue_final_message=request.continue_final_message, tools=tools,
                                      request_kwargs=request.template_kwargs(), documents=request.documents)
        ids = await self.tokenize_async(prompt, request.add_special_tokens)
        ids = self.truncate(ids, request.truncate_prompt_tokens, self.max_model_len)
        if not ids:
            raise ServingError("The rendered conversation is empty.", 400, "messages")
        self.check_length(len(ids), requested, param)
        template_kwargs = {**(self.frontend.default_chat_template_kwargs or {}), **(request.template_kwargs() or {})}
        try:
            parsing = self.parsing.for_request(prompt, tools, request.tool_choice, template_kwargs,
                                               request.include_reasoning, request.parallel_tool_calls)
        except ValueError as e:
            raise ServingError(str(e), 400, "tool_choice") from None
        params = self.sampling_params(request, len(ids), requested, logprobs, request.prompt_logprobs,
                                      request.stream)
        if parsing.forced is not None:
            # "required" / a named function: the output is the call(s), so a grammar makes the arguments parse.
            from tokenmill.structured import StructuredOutputsParams
            if params.structured_outputs is not None:
                raise ServingError("tool_choice 'required' or a named function cannot be combined with "
                                   "response_format / structured_outputs.", 400, "tool_choice")
            try:
                # Compact JSON: no token goes to whitespace inside the call (weak models wander in it until
                # max_tokens cuts the call short), and a "required" list is re-serialised for the client anyway.
                params.structured_outputs = self.structured_params(
                    request, override=StructuredOutputsParams(json=parsing.forced[0], disable_any_whitespace=True))
            except ValueError as e:
                raise ServingError(f"The tools' parameter schemas cannot be enforced: {e}", 400, "tools") from None
        if params.structured_outputs is not None and parsing.reasoning is not None and parsing.enabled \
                and not self.structured_config.enable_in_reasoning \
                and not parsing.reasoning.prompt_closes_reasoning(prompt):
            # Constrain only the answer: the grammar starts after the model's end-of-reasoning token (a tokenizer
            # without such a token cannot think, so then the grammar applies from the start).
            params._grammar_after_token_id = parsing.reasoning.end_token_id()
        if parsing.tools is not None and parsing.tools.needs_special_tokens:
            params.skip_special_tokens = False  # the call markers are special tokens
        beam = self.beam_params(request, params)
        if beam is not None and parsing.forced is not None:
            raise ServingError("tool_choice 'required' or a named function cannot be combined with "
                               "use_beam_search.", 400, "tool_choice")
        lora = self.models.lora_for(request.model)
        if beam is not None and lora is not None:
            raise ServingError("use_beam_search under a LoRA adapter is not supported yet.", 400, "model")
        if beam is not None:
            gen = self.start_beam(engine_id, prompt, ids, beam, request.priority, request.cache_salt,
                                  params.skip_special_tokens)
        else:
            gen = self.start(engine_id, prompt, ids, params, request.priority, request.cache_salt, lora)
        created = int(time.time())
        if request.stream:
            streams = await prime_all([gen])
            return SSEStream(self._stream(request, response_id, created, ids, streams[0], parsing), streams)
        final: RequestOutput | None = None
        try:
            async for res in gen:
                final = res
        finally:
            await gen.aclose()
        if final is None:
            raise EngineDeadError("the engine returned no output for a request")
        return self._response(request, response_id, created, ids, final, parsing)

    # ----- logprobs -----
    def chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, top_n: int,
                      as_ids: bool) -> ChatCompletionLogProbs:
        """With return_tokens_as_token_ids a token shows as "token_id:N", but its `bytes` stay the token's own
        bytes (as vLLM gives for the chosen token), so they still concatenate to the text."""
        content: list[ChatCompletionLogProbsContent] = []

        def shown(t: int, lp: Logprob | None) -> tuple[str, list[int]]:
            text = self.token_str(t, lp, False)
            return (self.token_str(t, lp, True) if as_ids else text), self.token_bytes(t, text, False)

        for i, tid in enumerate(token_ids):
            step = logprobs[i] if logprobs is not None and i < len(logprobs) else None
            chosen = step.get(tid) if step is not None else None
            token, token_bytes = shown(tid, chosen)
            top: list[ChatCompletionLogProb] = []
            if step is not None and top_n != 0:
                ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)
                if top_n > 0:
                    ranked = ranked[:top_n]
                for t, lp in ranked:
                    s, b = shown(t, lp)
                    top.append(ChatCompletionLogProb(token=s, logprob=max(lp.logprob, -9999.0), bytes=b))
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=max(chosen.logprob, -9999.0) if chosen is not None else -9999.0,
                bytes=token_bytes, top_logprobs=top))
        return ChatCompletionLogProbs(content=content)

    def _echo_text(self, request: ChatCompletionRequest, role: str) -> str:
        """vLLM's chat echo: the last message's content, when that message has the role being generated."""
        if not request.echo:
            return ""
        last = request.messages[-1]
        return message_text(last) if last.get("role") == role else ""

    # ----- one-shot -----
    def _response(self, request: ChatCompletionRequest, response_id: str, created: int, prompt_ids: list[int],
                  res: RequestOutput, parsing: RequestParsing) -> ChatCompletionResponse:
        role = self.request_role(request)
        echo = self._echo_text(request, role)
        as_ids = self.return_as_ids(request)
        choices = []
        completion_tokens = 0
        for out in res.outputs:
            completion_tokens += len(out.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(list(out.token_ids), out.logprobs, request.top_logprobs or 0, as_ids)
            message = ChatMessage(role=role, content=echo + out.text)
            finish_reason = out.finish_reason
            if parsing.active:
                parsed = parsing.parse(out.text)
                message = ChatMessage(role=role, content=(echo + parsed.content) if parsed.content else (echo or None),
                                      reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                                      tool_calls=parsed.tool_calls)
                if parsed.tool_calls and finish_reason == "stop" and not self._named_choice(parsing):
                    finish_reason = "tool_calls"  # (a forced named function ends with "stop", like OpenAI)
            choice = ChatCompletionResponseChoice(index=out.index, message=message, logprobs=logprobs,
                                                  finish_reason=finish_reason, stop_reason=out.stop_reason)
            if request.return_token_ids:
                choice.token_ids = list(out.token_ids)
            choices.append(choice)
        choices.sort(key=lambda c: c.index)
        self.log_output(response_id, [c.message.content or "" for c in choices])
        return ChatCompletionResponse(id=response_id, created=created, model=self.models.response_name(request.model),
                                      choices=choices, system_fingerprint=self.fingerprint,
                                      usage=self.usage(len(prompt_ids), completion_tokens, res.num_cached_tokens),
                                      prompt_logprobs=self.prompt_logprobs_json(res),
                                      prompt_token_ids=prompt_ids if request.return_token_ids else None)

    # ----- streaming -----
    async def _stream(self, request: ChatCompletionRequest, response_id: str, created: int, prompt_ids: list[int],
                      stream: Primed, parsing: RequestParsing) -> AsyncIterator[str]:
        model = self.models.response_name(request.model)
        role = self.request_role(request)
        echo = self._echo_text(request, role)
        include_usage, continuous = self.usage_flags(request)
        as_ids = self.return_as_ids(request)
        n = request.n
        tokens_out = [0] * n
        parsers = [parsing.new_stream() for _ in range(n)] if parsing.active else None
        cached = 0
        prompt_len = len(prompt_ids)

        def chunk(choice: ChatCompletionResponseStreamChoice, i: int, **extra: Any) -> str:
            c = ChatCompletionStreamResponse(id=response_id, object="chat.completion.chunk", created=created,
                                             model=model, choices=[choice], system_fingerprint=self.fingerprint,
                                             **extra)
            self.set_chunk_usage(c, include_usage, continuous, prompt_len, tokens_out[i], cached)
            return f"data: {c.model_dump_json(exclude_unset=True)}\n\n"

        try:
            # First, per choice: the role (and, with echo, the echoed text).
            for i in range(n):
                first = ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=role, content=""),
                                                           logprobs=None, finish_reason=None)
                if request.return_token_ids and i == 0:
                    yield chunk(first, i, prompt_token_ids=prompt_ids)
                else:
                    yield chunk(first, i)
                if echo:
                    yield chunk(ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo),
                                                                   logprobs=None, finish_reason=None), i)
            async for res in stream:
                if res.num_cached_tokens:
                    cached = res.num_cached_tokens
                for out in res.outputs:
                    i = out.index
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    tokens_out[i] += len(out.token_ids)
                    logprobs = None
                    if request.logprobs:
                        logprobs = self.chat_logprobs(list(out.token_ids), out.logprobs, request.top_logprobs or 0,
                                                      as_ids)
                    delta, finish_reason = DeltaMessage(content=out.text), out.finish_reason
                    if parsers is not None:
                        piece = parsers[i].feed(out.text)
                        if out.finish_reason is not None:
                            end = parsers[i].finish()
                            piece.content += end.content
                            piece.reasoning += end.reasoning
                            for entry in end.tool_calls:
                                piece.add_call(entry)
                            if parsers[i].tools_called and finish_reason == "stop" \
                                    and not self._named_choice(parsing):
                                finish_reason = "tool_calls"
                        # Only the parts this piece has: clients test `delta.tool_calls is not None` and then
                        # index it, so an empty list or a null field must not appear (vLLM and OpenAI omit them).
                        parts: dict[str, Any] = {}
                        if piece.content:
                            parts["content"] = piece.content
                        if piece.reasoning:
                            parts["reasoning_content"] = parts["reasoning"] = piece.reasoning
                        if piece.tool_calls:
                            parts["tool_calls"] = piece.tool_calls
                        delta = DeltaMessage(**parts)
                        if not piece and finish_reason is None and not (request.logprobs and out.token_ids):
                            continue  # held back (a possible tag or an unfinished tool call)
                    choice = ChatCompletionResponseStreamChoice(index=i, delta=delta, logprobs=logprobs,
                                                                finish_reason=finish_reason,
                                                                stop_reason=out.stop_reason)
                    if request.return_token_ids:
                        choice.token_ids = list(out.token_ids)
                    yield chunk(choice, i)
            if include_usage:
                c = ChatCompletionStreamResponse(id=response_id, object="chat.completion.chunk", created=created,
                                                 model=model, choices=[], system_fingerprint=self.fingerprint,
                                                 usage=self.usage(prompt_len, sum(tokens_out), cached))
                yield f"data: {c.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
        except Exception as e:  # as vLLM: any failure ends the stream with an error event, not a cut body
            yield sse_error_event(e)
        yield "data: [DONE]\n\n"

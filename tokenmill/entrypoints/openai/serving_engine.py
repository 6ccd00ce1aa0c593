"""What every OpenAI endpoint shares: model-name checks, error bodies, request ids, prompt tokenization, the context
length check, SamplingParams building (with the model's generation-config defaults), logprob formatting, request
logging and the set of in-flight requests (so shutdown can abort them)."""
from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from http import HTTPStatus
from typing import Any, AsyncIterator, Optional

from tokenmill.config.frontend import FrontendConfig
from tokenmill.engine.protocol import EngineClient
from tokenmill.entrypoints import best_of
from tokenmill.entrypoints.openai.protocol import (ErrorInfo, ErrorResponse, FieldError, PromptTokenUsageInfo,
                                                   UsageInfo)
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.logger import init_logger
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
                422: "BadRequestError", 431: "RequestHeaderFieldsTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
# Request fields that fall back to the model's generation config when the request leaves them unset (vLLM's list).
_DEFAULTED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
GENERATED_REQUEST_ID = "tokenmill.request_id"  # ASGI scope key: the X-Request-Id the server generated
# Texts shorter than this are encoded on the event loop: a worker thread's hand-off would cost more.
_INLINE_TOKENIZE_CHARS = 2048


class ServingError(Exception):
    """A request that cannot be served, with the HTTP status and the offending parameter."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.err_type = message, status, param, err_type


def error_type_for(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    except ValueError:
        return "Error"


def error_body(message: str, status: int = 400, param: str | None = None, err_type: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    if param is None:
        m = _PARAM_IN_MESSAGE.search(message)
        param = m.group(1) if m else None
    info = ErrorInfo(message=message, type=err_type or error_type_for(status), param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def sse_error_event(exc: BaseException) -> str:
    """The SSE event a stream ends with when a request fails after the response started."""
    from tokenmill.engine.protocol import EngineDeadError
    if isinstance(exc, EngineDeadError):
        body = error_body(f"The engine died: {exc}", 503)
    elif isinstance(exc, ServingError):
        body = error_body(exc.message, exc.status, exc.param)
    elif isinstance(exc, (ValueError, TypeError)):
        body = error_body(str(exc), 400)
    else:  # a failure nothing expected (as the non-streamed handler: a 500, logged with its traceback)
        logger.error("Internal error while streaming a response", exc_info=exc)
        body = error_body(f"Internal server error: {type(exc).__name__}: {exc}", 500)
    return f"data: {json.dumps(body)}\n\n"


def random_id() -> str:
    return uuid.uuid4().hex


class RequestTracker:
    """Engine request ids in flight, so a shutdown can abort them all."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def __len__(self) -> int:
        return len(self.ids)


async def merge_async_iterators(*iterators: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """Yields (index, item) from several async iterators as items arrive. Closing the merged iterator cancels the
    pending reads, which aborts the engine requests behind them."""
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut, i in pending.items():
            fut.cancel()
            _finalize_later(fut, iterators[i])


_background: set[asyncio.Task] = set()


def _finalize_later(fut: asyncio.Future, it: AsyncIterator) -> None:
    """Close `it` once its cancelled read has settled (a generator cannot be closed while it runs)."""
    async def close() -> None:
        try:
            await fut
        except BaseException:
            pass
        try:
            await it.aclose()
        except BaseException:
            pass
    task = asyncio.ensure_future(close())
    _background.add(task)
    task.add_done_callback(_background.discard)


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, frontend: FrontendConfig,
                 tracker: RequestTracker | None = None) -> None:
        self.engine = engine
        self.models = models
        self.frontend = frontend
        self.tracker = tracker if tracker is not None else RequestTracker()
        mc = engine.config.model_config
        self.max_model_len: int = mc.max_model_len
        self.max_logprobs: int = getattr(mc, "max_logprobs", 20)
        self.vocab_size: int | None = getattr(mc, "vocab_size", None)
        self.tokenizer = engine.tokenizer
        self._token_bytes: Any = None  # TokenBytes, built on the first chat logprobs
        self.fingerprint: str = models.fingerprint
        self.default_sampling_params = _as_dict(engine.get_default_sampling_params())
        from tokenmill.structured import StructuredOutputsConfig
        self.structured_config = StructuredOutputsConfig.from_dict(frontend.structured_outputs_config)

    # ----- checks -----
    def check_model(self, name: str | None) -> None:
        if not self.models.is_served(name):
            raise ServingError(f"The model `{name}` does not exist.", 404, "model", "NotFoundError")

    @staticmethod
    def check_supported(request: Any) -> None:
        bad = request.unsupported_fields()
        if bad:
            raise ServingError(f"{', '.join(bad)}: not supported yet by tokenmill.", 400,
                               bad[0].split(" ")[0])

    def check_logprobs(self, name: str, n: int | None) -> None:
        if n is None or self.max_logprobs == -1:
            return
        if n < -1:
            raise ServingError(f"{name} must be -1 (whole vocabulary) or >= 0, got {n}.", 400, name)
        asked = (self.vocab_size or float("inf")) if n == -1 else n
        if asked > self.max_logprobs:
            raise ServingError(f"Requested {name}={n}, but at most {self.max_logprobs} are allowed "
                               "(the server's --max-logprobs).", 400, name)

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str = "max_tokens",
                     input_param: str = "messages") -> None:
        """A 400 naming the context length when the prompt leaves no room, or the prompt plus max_tokens does not
        fit; `param` / `input_param` are the request fields to blame (the output budget, the input)."""
        m = self.max_model_len
        if prompt_len >= m:
            raise ServingError(
                f"This model's maximum context length is {m} tokens. However, your request has {prompt_len} "
                f"input tokens, which leaves no room for the completion ({max(m - prompt_len, 0)} tokens "
                "remain). Please reduce the length of the input messages.", 400, input_param)
        if max_tokens is not None and prompt_len + max_tokens > m:
            raise ServingError(
                f"This model's maximum context length is {m} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.", 400, param)

    # ----- request ids -----
    @staticmethod
    def request_ids(raw_request: Any, body_id: str | None, prefix: str) -> tuple[str, str]:
        """(the id shown to the client, the engine's base id). A client-chosen id (X-Request-Id header or the
        body's request_id) is shown as is; the engine's id gets a random suffix so two clients can reuse one."""
        header_id = raw_request.headers.get("x-request-id") if raw_request is not None else None
        chosen = header_id or body_id
        if chosen:
            return f"{prefix}{chosen}", f"{prefix}{chosen}-{random_id()[:8]}"
        generated = raw_request.scope.get(GENERATED_REQUEST_ID) if raw_request is not None else None
        rid = f"{prefix}{generated or random_id()}"
        return rid, rid

    # ----- prompts -----
    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ServingError("This server was started with skip_tokenizer_init: prompts must be token ids.",
                               400, "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def tokenize_async(self, text: str, add_special_tokens: bool) -> list[int]:
        """tokenize(), a long text in a worker thread: the encode (~1 ms per 1,000 tokens, the GIL released) then
        leaves the event loop to the streams. 64 requests of 1,024 tokens arriving at once blocked the loop for
        65-83 ms inline, 11-14 ms this way (this repository's CPU machine)."""
        if len(text) < _INLINE_TOKENIZE_CHARS:
            return self.tokenize(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenize, text, add_special_tokens)

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        v = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (v is not None and t >= v):
                raise ServingError(f"Token id {t!r} is out of vocabulary (valid ids are 0..{(v or 1) - 1}).",
                                   400, param)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids)

    @staticmethod
    def truncate(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
        if truncate_prompt_tokens is None:
            return ids
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep < 1:
            raise ServingError("truncate_prompt_tokens must be -1 or >= 1.", 400, "truncate_prompt_tokens")
        if keep > max_model_len:
            raise ServingError(f"truncate_prompt_tokens ({keep}) cannot exceed the maximum model length "
                               f"({max_model_len}).", 400, "truncate_prompt_tokens")
        return ids[-keep:]

    # ----- sampling params -----
    def sampling_params(self, request: Any, prompt_len: int, requested_max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None, stream: bool) -> SamplingParams:
        """vLLM semantics: request fields left unset take the generation config's defaults, then SamplingParams'
        defaults; max_tokens is the smallest of the request's, the room left in the context and the config's."""
        defaults = self.default_sampling_params
        candidates = [self.max_model_len - prompt_len, requested_max_tokens, defaults.get("max_tokens")]
        try:
            kwargs = request.sampling_kwargs()
            for name in _DEFAULTED_FIELDS:
                value = getattr(request, name)
                kwargs[name] = defaults.get(name) if value is None else value
            kwargs["max_tokens"] = min(c for c in candidates if c is not None)
            kwargs["logprobs"] = logprobs
            kwargs["prompt_logprobs"] = prompt_logprobs
            kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            kwargs["structured_outputs"] = self.structured_params(request)
            # With use_beam_search, n is the beam width (beam_params checks it), not n samples: greedy sampling's
            # n == 1 rule does not apply, so the params are built for one and carry n for beam_params.
            width = kwargs["n"] if getattr(request, "use_beam_search", False) else None
            if width is not None:
                SamplingParams(n=width)  # the width's checks as n (an integer >= 1, VLLM_MAX_N_SEQUENCES)
                kwargs["n"] = 1
            params = SamplingParams.from_optional(**kwargs)
            if width is not None:
                params.n = width
        except (TypeError, ValueError) as e:   # a FieldError names its request field; SamplingParams' messages do
            raise ServingError(str(e), 400, getattr(e, "param", None)) from None
        if stream and params.best_of is not None and params.best_of > params.n:
            raise ServingError(f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best results "
                               "are known only once every candidate is complete.", 400, "best_of")
        return params

    def structured_params(self, request: Any, override: Any = None) -> Any:
        """The request's constraint with the server's --structured-outputs-config options folded in; checked
        (schema, regex, grammar syntax) here so a bad one is a 400 before the request reaches the engine."""
        params = override if override is not None else request.structured_params()
        if params is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, but this server runs with skip_tokenizer_init.")
        from tokenmill.structured.backend_xgrammar import validate_structured_outputs
        cfg = self.structured_config
        params.disable_any_whitespace |= cfg.disable_any_whitespace
        params.disable_additional_properties |= cfg.disable_additional_properties
        try:
            validate_structured_outputs(params, cfg)
        except ValueError as e:
            field = None if override is not None else request.constraint_field()
            if not field:
                raise
            message = str(e) if field == "structured_outputs" else f"{field}: {e}"
            raise FieldError(message, field) from None
        return params

    # ----- responses -----
    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> UsageInfo:
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        if self.frontend.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens or 0)
        return usage

    def set_chunk_usage(self, chunk: Any, include: bool, continuous: bool, prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int | None) -> None:
        """A stream chunk's usage field (usage_flags' two flags): the running counts with continuous usage stats,
        else null when a final usage chunk will come (OpenAI sends "usage": null on every chunk before it), else
        left unset (absent from the JSON)."""
        if continuous:
            chunk.usage = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        elif include:
            chunk.usage = None

    def usage_flags(self, request: Any) -> tuple[bool, bool]:
        """(send a final usage chunk, send usage with every chunk)."""
        opts = request.stream_options
        force = self.frontend.enable_force_include_usage
        asked = opts is not None and (opts.include_usage if opts.include_usage is not None
                                      else bool(opts.continuous_usage_stats))
        include = force or bool(asked)
        continuous = include and bool(opts and opts.continuous_usage_stats)
        return include, continuous

    def token_str(self, token_id: int, lp: Optional[Logprob], as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, token: str, as_ids: bool) -> list[int]:
        """The chat logprobs' `bytes` of a token shown as `token` (see TokenBytes; with token ids shown, the bytes
        of that text)."""
        if as_ids or self.tokenizer is None:
            return list(token.encode("utf-8", errors="replace"))
        if self._token_bytes is None:
            from tokenmill.engine.logprobs import TokenBytes
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes(token_id, token)

    def return_as_ids(self, request: Any) -> bool:
        v = getattr(request, "return_tokens_as_token_ids", None)
        return self.frontend.return_tokens_as_token_ids if v is None else bool(v)

    @staticmethod
    def prompt_logprobs_json(res: RequestOutput) -> list[dict[int, Any] | None] | None:
        if res.prompt_logprobs is None:
            return None
        return [None if d is None else {tid: {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                                              "decoded_token": lp.decoded_token} for tid, lp in d.items()}
                for d in res.prompt_logprobs]

    # ----- logging -----
    def log_request(self, request_id: str, prompt: str | None, ids: list[int] | None,
                    params: SamplingParams) -> None:
        if not self.frontend.enable_log_requests:
            return
        n = self.frontend.max_log_len
        if prompt is not None and n is not None:
            prompt = prompt[:n]
        if ids is not None and n is not None:
            ids = ids[:n]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id, prompt,
                    params, ids)

    def log_output(self, request_id: str, texts: list[str]) -> None:
        if not (self.frontend.enable_log_requests and self.frontend.enable_log_outputs):
            return
        n = self.frontend.max_log_len
        logger.info("Generated response %s: %r", request_id, [t[:n] if n is not None else t for t in texts])

    # ----- beam search -----
    def beam_params(self, request: Any, params: SamplingParams) -> Any:
        """BeamSearchParams for a use_beam_search request (n beams), None otherwise; a 400 for fields beam search
        cannot honour, and for length_penalty without beam search."""
        if not request.use_beam_search:
            if request.length_penalty is not None:
                raise ServingError("length_penalty applies to beam search only; set use_beam_search.", 400,
                                   "length_penalty")
            return None
        if request.length_penalty is not None and not math.isfinite(request.length_penalty):
            raise ServingError(f"length_penalty must be a finite number, got {request.length_penalty}.", 400,
                               "length_penalty")
        bad = request.beam_search_conflicts()
        if params.logprobs is not None:
            bad.append("logprobs")
        if bad:
            raise ServingError(f"{', '.join(bad)}: cannot be combined with use_beam_search.", 400, bad[0])
        from tokenmill.beam_search import check_beam_width
        from tokenmill.sampling_params import BeamSearchParams
        try:
            check_beam_width(params.n, self.max_logprobs)
        except ValueError as e:
            raise ServingError(str(e), 400, "n") from None
        temperature = request.temperature
        if temperature is None:
            temperature = self.default_sampling_params.get("temperature", 1.0)
        try:
            return BeamSearchParams(
                beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                temperature=temperature, include_stop_str_in_output=params.include_stop_str_in_output,
                length_penalty=1.0 if request.length_penalty is None else request.length_penalty)
        except ValueError as e:
            raise ServingError(str(e), 400, "use_beam_search") from None

    def start_beam(self, engine_id: str, prompt: str | None, ids: list[int], params: Any, priority: int,
                   cache_salt: str | None = None, skip_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Beam search for one prompt (tokenmill/beam_search.py), as a stream of one final RequestOutput whose n
        outputs are the best beams. Each beam step is a one-token engine request of its own."""
        from tokenmill.beam_search import beam_search_async
        self.check_awake()
        self.check_priority(priority)
        from tokenmill.outputs import CompletionOutput
        processor = getattr(self.engine, "processor", None)
        eos = processor.eos_token_id if processor is not None else getattr(self.tokenizer, "eos_token_id", None)

        async def one(tokens: list[int], sp: SamplingParams, sub_id: str) -> RequestOutput:
            p: dict[str, Any] = {"prompt_token_ids": tokens}
            if cache_salt is not None:
                p["cache_salt"] = cache_salt
            final = None
            async for out in self.engine.generate(p, sp, sub_id, priority=priority):
                final = out
            if final is None:
                raise RuntimeError("the engine returned no output for a beam-search step")
            return final

        async def run() -> AsyncIterator[RequestOutput]:
            res = await beam_search_async(one, ids, params, eos, self.max_logprobs, self.tokenizer, engine_id,
                                          skip_special_tokens)
            outputs = [CompletionOutput(index=i, text=s.text or "", token_ids=s.tokens[len(ids):],
                                        cumulative_logprob=s.cum_logprob, logprobs=None,
                                        finish_reason=s.finish_reason)
                       for i, s in enumerate(res.sequences)]
            yield RequestOutput(engine_id, prompt, ids, None, outputs, True, num_cached_tokens=0)

        return self._tracked(engine_id, run())

    def check_priority(self, priority: int) -> None:
        """A non-zero priority needs --scheduling-policy priority (the engine would refuse it without naming it)."""
        sched = getattr(getattr(self.engine, "config", None), "scheduler_config", None)
        policy = getattr(sched, "scheduling_policy", "priority")
        if priority != 0 and policy != "priority":
            raise ServingError(f"priority={priority} needs the server started with --scheduling-policy priority "
                               f"(this one schedules {policy!r}); leave priority at 0.", 400, "priority")

    def check_awake(self) -> None:
        if getattr(self.engine, "sleeping", False):  # POST /sleep (dev_routes.py) released the model's memory
            raise ServingError("The engine is sleeping (POST /sleep released its memory): POST /wake_up before "
                               "generating.", 503, None, "ServiceUnavailableError")

    # ----- generation -----
    def start(self, engine_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
              priority: int, cache_salt: str | None = None, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """The engine's stream for one prompt (under `lora_request`'s adapter when given), tracked while it runs."""
        self.check_awake()
        self.check_priority(priority)
        engine_prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if prompt is not None:
            engine_prompt["prompt"] = prompt
        if cache_salt is not None:
            engine_prompt["cache_salt"] = cache_salt
        self.log_request(engine_id, prompt, ids, params)
        params, pick = best_of.expand(params)
        extra = {"lora_request": lora_request} if lora_request is not None else {}
        gen = self.engine.generate(engine_prompt, params, engine_id, priority=priority, **extra)
        if pick is not None:
            gen = best_of.select_final(gen, pick)
        return self._tracked(engine_id, gen)

    async def _tracked(self, engine_id: str, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        self.tracker.ids.add(engine_id)
        try:
            async for out in gen:
                yield out
        finally:
            self.tracker.ids.discard(engine_id)
            await gen.aclose()


_NOTHING = object()


class Primed:
    """An engine stream whose first item was read up front, so validation errors surface before a streaming
    response starts. Iterating yields that item and then the rest; `aclose()` always closes the stream (aborting its
    request), even when iteration never began."""

    def __init__(self, gen: AsyncIterator) -> None:
        self._gen = gen
        self._first: Any = _NOTHING

    async def prime(self) -> "Primed":
        self._first = await anext(self._gen)
        return self

    def __aiter__(self) -> "Primed":
        return self

    async def __anext__(self) -> Any:
        if self._first is not _NOTHING:
            first, self._first = self._first, _NOTHING
            return first
        return await anext(self._gen)

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        except RuntimeError:  # being read right now: the reader's cancellation closes it
            pass


async def prime_all(gens: list[AsyncIterator]) -> list[Primed]:
    """Primes every stream concurrently; on the first error, closes them all and re-raises it."""
    primed = [Primed(g) for g in gens]
    if len(primed) == 1:
        try:
            await primed[0].prime()
        except BaseException:
            await primed[0].aclose()
            raise
        return primed
    tasks = [asyncio.ensure_future(p.prime()) for p in primed]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in primed:
            await p.aclose()
        raise
    return primed


class SSEStream:
    """A streaming response body plus the engine streams behind it; `close()` releases them all (the HTTP layer
    calls it when the response ends, whether it completed, failed or the client went away)."""

    def __init__(self, body: AsyncIterator[str], sources: list[Primed]) -> None:
        self.body = body
        self.sources = sources

    async def close(self) -> None:
        try:
            await self.body.aclose()
        except RuntimeError:
            pass
        for s in self.sources:
            await s.aclose()


def _as_dict(defaults: Any) -> dict[str, Any]:
    if defaults is None:
        return {}
    if isinstance(defaults, dict):
        return dict(defaults)
    if isinstance(defaults, SamplingParams):  # an engine that returns a SamplingParams: keep what differs
        base = SamplingParams()
        return {f: getattr(defaults, f) for f in defaults.__struct_fields__
                if not f.startswith("_") and getattr(defaults, f) != getattr(base, f)}
    return dict(defaults)

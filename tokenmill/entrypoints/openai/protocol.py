"""Request and response models of the OpenAI-compatible API, with vLLM's extra fields and shapes.

Requests accept unknown fields (OpenAI clients send new ones all the time) and log a warning naming them, as vLLM
does. Fields tokenmill cannot honour yet are declared here so a request that sets them gets a clear 400 instead of
being silently ignored (see `unsupported_fields`).
"""
from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from tokenmill.logger import init_logger

logger = init_logger(__name__)

_LONG_MIN, _LONG_MAX = -(2 ** 63), 2 ** 63 - 1


def _accepts_none(annotation: Any) -> bool:
    import types
    import typing
    return annotation is type(None) or annotation is Any or type(None) in typing.get_args(annotation) or (
        isinstance(annotation, types.UnionType) and type(None) in annotation.__args__)


def _has_lone_surrogate(value: Any) -> bool:
    """True when a string in `value` holds an unpaired UTF-16 surrogate (JSON's "\\ud800" parses to one): no
    tokenizer can encode it. Lists of numbers (token ids) are skipped without a walk."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list) and value and not isinstance(value[0], (int, float)):
        return any(_has_lone_surrogate(v) for v in value)
    return False


class FieldError(ValueError):
    """A bad request value found by a check that spans fields (a model validator, a later conversion): the
    message plus the request field to report as the error's `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    """Base of every API model: unknown request fields are allowed, logged once per request and ignored."""
    model_config = ConfigDict(extra="allow")
    # True for a model whose unknown fields are read by its consumer (no "ignored" warning for them).
    extra_is_consumed: ClassVar[bool] = False
    # True for a request body: its strings are checked for unpaired surrogates (responses built here are not).
    is_client_body: ClassVar[bool] = False

    @model_validator(mode="wrap")
    @classmethod
    def _warn_unknown_fields(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            # Clients that serialise every field send `null` for "unset": for a field that cannot hold null,
            # that means its default (fields that can hold null keep it: max_tokens null = as many as fit).
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and not _accepts_none(fields[k].annotation))}
            bad = next((k for k, v in data.items() if _has_lone_surrogate(v)), None) if cls.is_client_body else None
            if bad is not None:
                raise FieldError(f"{bad} holds an unpaired UTF-16 surrogate (such as \\ud800), which is not valid "
                                 "Unicode text; send each character as a whole code point or a surrogate pair.", bad)
        result = handler(data)
        if isinstance(data, dict) and result.model_extra and not cls.extra_is_consumed:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(result.model_extra))
        return result


# ----------------------------------------------------------------------------------------------------------------
# errors, models, usage
# ----------------------------------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    id: str
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class StreamOptions(OpenAIBaseModel):
    # Unset: no usage chunk (OpenAI's reading of stream_options: {}), unless continuous_usage_stats asks for usage.
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = False
    # OpenAI pads chunks with a random `obfuscation` field against a network side channel; no client reads it and
    # the text is the same either way, so it is accepted and none is sent (as on /v1/responses).
    include_obfuscation: Optional[bool] = None


class ResponseFormat(OpenAIBaseModel):
    """Kept whole: structured.from_response_format reads and validates json_schema and structural_tag's fields."""
    extra_is_consumed: ClassVar[bool] = True
    type: str = "text"


# ----------------------------------------------------------------------------------------------------------------
# fields shared by /v1/completions and /v1/chat/completions
# ----------------------------------------------------------------------------------------------------------------
class _SamplingRequest(OpenAIBaseModel):
    is_client_body: ClassVar[bool] = True
    model: Optional[str] = None
    n: int = 1
    best_of: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = None
    # Ints the engine receives are bounded to 64 bits: a larger one could not be sent to the engine process (a 500).
    top_k: Optional[int] = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    truncate_prompt_tokens: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    priority: int = Field(0, ge=_LONG_MIN, le=_LONG_MAX)
    request_id: Optional[str] = None
    # Requests share prefix-cache entries only with requests of the same salt (multi-tenant isolation).
    cache_salt: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: bool = False
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's older spellings of structured outputs
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    # Beam search (not streamed): n is the beam width; length_penalty ranks the finished beams.
    use_beam_search: bool = False
    length_penalty: Optional[float] = None
    # vLLM fields tokenmill does not implement yet: setting them is a 400, never a silent no-op.
    logits_processors: Optional[Any] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None

    _NOT_YET: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("logits_processors", None), ("kv_transfer_params", None), ("vllm_xargs", None), ("mm_processor_kwargs", None))

    def unsupported_fields(self) -> list[str]:
        """Names of fields set to something tokenmill cannot honour yet (each one makes the request a 400)."""
        bad = [name for name, default in self._NOT_YET if getattr(self, name) != default]
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            bad.append(f"guided_decoding_backend {self.guided_decoding_backend!r} (only xgrammar)")
        return bad

    # Fields beam search cannot honour, with their neutral values (a neutral value is not an error).
    _NOT_WITH_BEAMS: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("stream", False), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
        ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("seed", None), ("stop", None), ("stop_token_ids", None),
        ("bad_words", None), ("logit_bias", None), ("allowed_token_ids", None), ("min_tokens", 0),
        ("best_of", None), ("prompt_logprobs", None), ("response_format", None), ("structured_outputs", None),
        ("guided_json", None), ("guided_regex", None), ("guided_choice", None), ("guided_grammar", None))

    def beam_search_conflicts(self) -> list[str]:
        """The fields set here that beam search cannot honour (each one makes a beam-search request a 400)."""
        neutral = {"top_k": (-1, 0), "stop": (None, [], ""), "stop_token_ids": (None, []), "bad_words": (None, [])}
        bad = []
        for name, default in self._NOT_WITH_BEAMS:
            value = getattr(self, name, default)
            if value is not None and value not in neutral.get(name, (default,)):
                if name == "response_format" and getattr(value, "type", None) == "text":
                    continue
                bad.append(name)
        return bad

    def structured_params(self) -> Any:
        """The request's output constraint (structured_outputs, response_format or the guided_* fields), or None.
        More than one of them is a ValueError."""
        from tokenmill.structured import StructuredOutputsParams, from_response_format
        found = []
        if self.structured_outputs is not None:
            so = dict(self.structured_outputs)
            so.pop("backend", None)
            try:
                found.append(("structured_outputs", StructuredOutputsParams(**so)))
            except (TypeError, ValueError) as e:  # TypeError: an unknown key
                raise FieldError(f"structured_outputs: {e}", "structured_outputs") from None
        try:
            rf = from_response_format(self.response_format) if self.response_format is not None else None
        except ValueError as e:
            raise FieldError(str(e), "response_format") from None
        if rf is not None:
            found.append(("response_format", rf))
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar))
                  if v is not None}
        names = [f"guided_{k}" for k in guided]
        if len(guided) > 1:
            raise FieldError(f"Give only one of {', '.join(names)}: a request has one output constraint.", names[1])
        if guided:
            try:
                so = StructuredOutputsParams(**guided, whitespace_pattern=self.guided_whitespace_pattern)
            except ValueError as e:
                raise FieldError(f"{names[0]}: {e}", names[0]) from None
            found.append((names[0], so))
        if len(found) > 1:
            raise FieldError("Give only one of " + ", ".join(name for name, _ in found)
                             + ": a request has one output constraint.", found[1][0])
        return found[0][1] if found else None

    def constraint_field(self) -> str | None:
        """The request field that holds the output constraint (for error messages), or None."""
        def sets(name: str) -> bool:
            value = getattr(self, name)
            return value is not None and not (name == "response_format" and getattr(value, "type", None) == "text")
        return next((name for name in ("structured_outputs", "response_format", "guided_json", "guided_regex",
                                       "guided_choice", "guided_grammar") if sets(name)), None)

    @model_validator(mode="after")
    def _check_stream_fields(self) -> "_SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options can only be set when stream is true.", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs is not available when stream is true.", "prompt_logprobs")
        if self.cache_salt == "":  # as vLLM: an empty salt is a mistake, not "no salt"
            raise FieldError("cache_salt must be a non-empty string if provided.", "cache_salt")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields taken verbatim from the request (None = use the default)."""
        logit_bias = None
        if self.logit_bias is not None:
            try:
                logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in self.logit_bias.items()}
            except ValueError:
                raise FieldError("logit_bias keys must be token ids (integers given as strings).",
                                 "logit_bias") from None
            if not all(math.isfinite(float(v)) for v in self.logit_bias.values()):  # JSON's NaN would clamp to 100
                raise FieldError("logit_bias values must be finite numbers (-100 to 100).", "logit_bias")
        return dict(n=self.n, best_of=self.best_of, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
                    stop_token_ids=self.stop_token_ids, bad_words=self.bad_words,
                    include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                    min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                    spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=logit_bias,
                    allowed_token_ids=self.allowed_token_ids, truncate_prompt_tokens=self.truncate_prompt_tokens)


# ----------------------------------------------------------------------------------------------------------------
# /v1/completions
# ----------------------------------------------------------------------------------------------------------------
class CompletionRequest(_SamplingRequest):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    add_special_tokens: bool = True
    prompt_embeds: Optional[Any] = None

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        # An empty suffix (what fill-in-the-middle clients send at the end of a file) asks for nothing.
        bad += [name for name in ("suffix", "prompt_embeds") if getattr(self, name) not in (None, "")]
        return bad


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = Field(default=None)
    system_fingerprint: Optional[str] = None


# ----------------------------------------------------------------------------------------------------------------
# /v1/chat/completions
# ----------------------------------------------------------------------------------------------------------------
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's values


def _check_tools(tools: Optional[list[dict[str, Any]]], tool_choice: Any) -> None:
    """The shapes vLLM's pydantic models enforce: each tool {"type": "function" (the default), "function": {"name":
    str, "description"?: str, "parameters"?: object}}; a dict tool_choice {"type": "function", "function": {"name":
    str}}. A missing "type" is filled in. (Without this a nameless tool was forced into calls with no name.)"""
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        tool.setdefault("type", "function")
        if tool["type"] != "function":
            raise FieldError(f"{where}.type must be \"function\"; got {tool['type']!r}.", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{where}.function must be an object with a \"name\"; got {fn!r}.", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{where}.function.name must be a non-empty string; got {fn.get('name')!r}.", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise FieldError(f"{where}.function.parameters must be a JSON Schema object; got "
                             f"{fn['parameters']!r}.", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise FieldError(f"{where}.function.description must be a string.", "tools")
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        ok = tool_choice.get("type", "function") == "function" and isinstance(fn, dict) \
            and isinstance(fn.get("name"), str)
    else:
        ok = tool_choice in (None, "none", "auto", "required")
    if not ok:
        raise FieldError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         f'{{"name": ...}}}}; got {tool_choice!r}.', "tool_choice")
    if not tools and tool_choice not in (None, "none"):  # as OpenAI and vLLM: a choice among no tools is an error
        raise FieldError(f"tool_choice {tool_choice!r} needs `tools` to be set.", "tool_choice")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = Field(None, description="Deprecated by OpenAI in favour of max_completion_tokens.")
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True
    reasoning_effort: Optional[str] = None
    # OpenAI fields that change no output here, so they are accepted (not logged as ignored): metadata and store
    # tag a stored completion (tokenmill stores none; fetching one is a clear 404), service_tier picks a billing
    # tier, prediction only speeds up decoding, the prompt_cache_* fields tune a cache that works without them,
    # safety_identifier is an abuse hint.
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prediction: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    safety_identifier: Optional[str] = None
    # OpenAI fields that would change the output but cannot be honoured: setting them is a 400 naming them
    # (moderation can block a request or its answer; there is no moderation model here).
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    verbosity: Optional[str] = None
    moderation: Optional[dict[str, Any]] = None
    _tool_choice_defaulted: bool = PrivateAttr(default=False)

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        bad += [name for name in ("functions", "function_call", "audio", "web_search_options", "moderation")
                if getattr(self, name) is not None]
        if self.verbosity not in (None, "medium"):  # OpenAI's default; as text.verbosity on /v1/responses
            bad.append(f"verbosity {self.verbosity!r} (only 'medium')")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            bad.append(f"modalities {self.modalities!r} (text output only)")
        return bad

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """The request's chat-template variables: `chat_template_kwargs`, plus `reasoning_effort` as the variable
        of that name (as vLLM passes it; templates that know it, e.g. gpt-oss's, use it, and an explicit
        chat_template_kwargs entry wins)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if not self.messages:
            raise FieldError("messages must contain at least one message.", "messages")
        if self.top_logprobs is not None:
            if self.top_logprobs < 0 and self.top_logprobs != -1:
                raise FieldError("top_logprobs must be -1 (whole vocabulary) or >= 0.", "top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise FieldError("When using top_logprobs, logprobs must be set to true.", "top_logprobs")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise FieldError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got "
                             f"{self.reasoning_effort!r}.", "reasoning_effort")
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("Cannot set both continue_final_message and add_generation_prompt to true.",
                             "continue_final_message")
        _check_tools(self.tools, self.tool_choice)
        if "tool_choice" not in self.model_fields_set and self.tools:
            # OpenAI's (and vLLM's) default once tools are given: a server that cannot parse calls then says so
            # (a 400 naming the flags) instead of returning the model's raw call text as content. An explicit
            # null keeps vLLM's meaning: the tools go to the template and the output is not parsed.
            self.tool_choice = "auto"
            self._tool_choice_defaulted = True
        return self


class ChatMessage(OpenAIBaseModel):
    role: str
    content: Optional[str] = None
    refusal: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM's field; `reasoning` is the newer name, both are filled
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatCompletionLogProbsContent]] = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None
    prompt_token_ids: Optional[list[int]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = Field(default=None)
    system_fingerprint: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None

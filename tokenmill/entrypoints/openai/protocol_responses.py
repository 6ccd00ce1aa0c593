"""Request and response models of OpenAI's Responses API (POST /v1/responses): text generation and function
tools.

Like the chat and completion models, unknown request fields are accepted and logged (see OpenAIBaseModel). The
Responses fields that would change the result but that tokenmill cannot honour are declared, so that setting them is
a 400 naming the field (`unsupported_fields`) rather than a silent no-op.
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import OpenAIBaseModel

_LONG_MIN, _LONG_MAX = -(2 ** 63), 2 ** 63 - 1

_NOTHING_STORED = ("tokenmill keeps no responses (store is accepted, but nothing is stored), so a response cannot "
                   "build on an earlier one: send the whole conversation in `input`")


class ResponsesRequest(OpenAIBaseModel):
    is_client_body: ClassVar[bool] = True
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[float] = None
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None  # only include_obfuscation, which changes no text
    text: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    seed: Optional[int] = Field(None, ge=_LONG_MIN, le=_LONG_MAX)  # a vLLM extra, as on the chat route
    # Function tools: the model's calls come back as function_call items (the server runs no tool).
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # Hints that change nothing here: max_tool_calls bounds built-in tools (there are none), and the prefix cache
    # works without a key, retention or options.
    max_tool_calls: Optional[int] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    # Fields tokenmill cannot honour: setting them is a 400.
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    background: Optional[bool] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    prompt: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = None
    truncation: Optional[str] = None
    context_management: Optional[Any] = None
    moderation: Optional[dict[str, Any]] = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something tokenmill cannot honour; any one makes the request a 400."""
        bad: list[tuple[str, str]] = []
        if self.previous_response_id is not None:
            bad.append(("previous_response_id", _NOTHING_STORED))
        if self.conversation is not None:
            bad.append(("conversation", _NOTHING_STORED))
        if self.background:
            bad.append(("background", "background responses must be stored to be fetched later, and tokenmill "
                                      "keeps no responses"))
        for key, value in (self.reasoning or {}).items():
            if value is not None and key != "effort":  # effort: the chat route's reasoning_effort
                bad.append(("reasoning", f"reasoning.{key}={value!r} is not supported by tokenmill (the model "
                                         "reasons as its chat template and the server's reasoning parser decide)"))
        if self.include:
            bad.append(("include", f"{self.include!r}: no extra output data is available from tokenmill"))
        if self.prompt is not None:
            bad.append(("prompt", "stored prompt templates are not available on tokenmill"))
        if self.top_logprobs:
            bad.append(("top_logprobs", "logprobs are not supported yet on /v1/responses"))
        if self.truncation not in (None, "disabled"):
            bad.append(("truncation", f"{self.truncation!r} is not supported; only 'disabled' (an input too long "
                                      "for the context is a 400)"))
        if self.context_management is not None:
            bad.append(("context_management", "not supported by tokenmill"))
        if self.moderation is not None:
            bad.append(("moderation", "tokenmill runs no moderation model, so nothing could be scored or blocked"))
        return bad


class ResponsesResponse(OpenAIBaseModel):
    """A Response object; `output` holds plain item dicts (messages and reasoning) to keep building them cheap."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: str
    incomplete_details: Optional[dict[str, Any]] = None
    error: Optional[dict[str, Any]] = None
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: Optional[dict[str, Any]] = None
    instructions: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    tool_choice: Union[str, dict[str, Any]] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_output_tokens: Optional[int] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    background: bool = False
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    user: Optional[str] = None

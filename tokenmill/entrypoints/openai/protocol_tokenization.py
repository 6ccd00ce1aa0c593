"""Request and response models of /tokenize and /detokenize (vLLM's shapes)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import Discriminator, Tag, model_validator

from tokenmill.entrypoints.openai.protocol import FieldError, OpenAIBaseModel


class TokenizeCompletionRequest(OpenAIBaseModel):
    is_client_body: ClassVar[bool] = True
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIBaseModel):
    is_client_body: ClassVar[bool] = True
    model: Optional[str] = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    documents: Optional[list[dict[str, str]]] = None

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        # Before validation, so the refused field is not first logged as an ignored extra.
        if isinstance(data, dict) and "prompt" in data:
            raise FieldError("Give either prompt (text) or messages (a chat), not both.", "prompt")
        return data

    @model_validator(mode="after")
    def _check(self) -> "TokenizeChatRequest":
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("Cannot set both continue_final_message and add_generation_prompt to true.",
                             "continue_final_message")
        return self


def _tokenize_kind(data: Any) -> str:
    if isinstance(data, dict):
        return "chat" if "messages" in data else "completion"
    return "chat" if isinstance(data, TokenizeChatRequest) else "completion"


# A body with `messages` is a chat request, any other a completion one: validation errors then name the fields of
# the form the client meant, not both union members. The tags appear in error locations; the error handler drops them.
UNION_TAGS = frozenset({"completion", "chat"})
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("completion")],
                                  Annotated[TokenizeChatRequest, Tag("chat")]], Discriminator(_tokenize_kind)]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

"""vLLM's prompt types (`vllm.inputs`): the forms a prompt may take in `LLM.generate`, `LLMEngine.add_request` and
`AsyncLLM.generate`. TypedDicts, so a plain dict with the same keys is the same thing at run time; keys beyond these
are rejected by the engine with an error naming them (tokenmill serves text-only models)."""
from __future__ import annotations

from typing import TypedDict, Union

try:
    from typing import NotRequired
except ImportError:  # Python 3.10 (typing_extensions comes with pydantic)
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""
    prompt: str
    cache_salt: NotRequired[str]      # isolates this request's prefix-cache entries from requests without it


class TokensPrompt(TypedDict):
    """A prompt as token ids (used as given); `prompt` is only echoed back in the output."""
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

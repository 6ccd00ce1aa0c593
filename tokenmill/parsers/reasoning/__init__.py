"""Reasoning parsers: split a model's output into reasoning (e.g. inside <think>...</think>) and the answer."""
from __future__ import annotations

import abc
from dataclasses import dataclass

from tokenmill.parsers.registry import ParserRegistry

reasoning_parsers = ParserRegistry("reasoning", {
    "deepseek_r1": ("tokenmill.parsers.reasoning.think_tags", "DeepSeekR1ReasoningParser"),
    "qwen3": ("tokenmill.parsers.reasoning.think_tags", "Qwen3ReasoningParser"),
})


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream(abc.ABC):
    """Per-request streaming state. feed() the text as it arrives; finish() flushes anything held back.

    Contract: concatenating the deltas of every feed() plus finish(), for ANY split of the text into chunks, equals
    the non-streamed `ReasoningParser.extract(text)` result.
    """

    @abc.abstractmethod
    def feed(self, delta_text: str) -> ReasoningDelta: ...

    @abc.abstractmethod
    def finish(self) -> ReasoningDelta: ...

    @property
    @abc.abstractmethod
    def reasoning_ended(self) -> bool:
        """True once the answer part has started (structured outputs constrain only what follows)."""


class ReasoningParser(abc.ABC):
    """Built once per server from the tokenizer. `prompt_opens_reasoning` says whether the rendered prompt already
    ends inside a reasoning block (e.g. a chat template that appends `<think>\\n`), so the output starts as reasoning
    without an opening tag; `enabled=False` (thinking disabled through chat_template_kwargs) means all content.

    A parser lists the tags a model marks its reasoning with in `required_tokens`; construction raises ValueError
    when the tokenizer's vocabulary lacks one of them (as vLLM's parsers do): such a model never writes the tags
    the parser looks for. A tokenizer of None (skip_tokenizer_init, unit tests of the text rules) is not checked.
    """

    #: The name the parser is registered under (--reasoning-parser NAME), for error messages.
    name: str = ""
    #: Tokens the tokenizer must have, each as one vocabulary entry.
    required_tokens: tuple[str, ...] = ()

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if tokenizer is not None and self.required_tokens:
            vocab = tokenizer.get_vocab()
            missing = [t for t in self.required_tokens if t not in vocab]
            if missing:
                raise ValueError(
                    f"--reasoning-parser {self.name or type(self).__name__}: the tokenizer has no "
                    f"{' or '.join(map(repr, missing))} token, so this model does not mark its reasoning the way the "
                    "parser expects (its whole output could be reported as reasoning). Choose the parser made for "
                    "this model, or leave --reasoning-parser unset.")

    @abc.abstractmethod
    def extract(self, text: str, prompt_opens_reasoning: bool = False, enabled: bool = True) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a complete output."""

    @abc.abstractmethod
    def new_stream(self, prompt_opens_reasoning: bool = False, enabled: bool = True) -> ReasoningStream: ...

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """Whether the rendered prompt leaves the model inside a reasoning block."""
        return False

    end_tag = "</think>"

    def prompt_closes_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt already ended the reasoning block (e.g. thinking disabled by the template)."""
        return prompt_text.rstrip().endswith(self.end_tag)

    def end_token_id(self) -> int | None:
        """The token id of the end-of-reasoning tag, when the tokenizer has it as one token."""
        if self.tokenizer is None:
            return None
        ids = self.tokenizer.encode(self.end_tag, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

"""Reasoning parsers for models that think inside `<think>...</think>`: DeepSeek-R1 and Qwen3.

Rules shared by both parsers (whole and streamed output give exactly the same result):

- Reasoning is the text of the reasoning block, verbatim, with any `<think>` tag inside it removed (a model that
  repeats the opening tag, or DeepSeek-R1 emitting it although its prompt already opened the block).
- Content is the text after `</think>`, with leading newlines ("\\n", "\\r") stripped: models write
  `</think>\\n\\nAnswer`, and the answer should start at "Answer". Only newlines are stripped, never spaces, so
  indented code keeps its indentation. Anything after `</think>` (including further tags) is plain content.
- An empty reasoning or content is reported as None.
- `enabled=False` (thinking disabled through chat_template_kwargs): the whole output is content.
- Where the output starts:
    * DeepSeek-R1's template ends the prompt with `<think>\\n`, so the output starts inside the reasoning block
      whether or not it repeats the opening tag: everything up to `</think>` is reasoning, and an output without
      `</think>` (ran out of tokens while thinking) is all reasoning with content None.
    * Qwen3 starts inside the block only if `prompt_opens_reasoning` (the rendered prompt ends in an unclosed
      `<think>`). Otherwise the output is reasoning only when it starts with `<think>` (after optional newlines);
      an output that starts with anything else is all content and tags in it are not interpreted. A `<think>`
      without `</think>` (max_tokens hit mid-thought) makes the rest all reasoning, except that a tool call in
      Qwen3-Coder / Qwen3.5 form (`<tool_call>`, optional whitespace, then `<function=` or `<function `) ends the
      reasoning too: Qwen3.5 emits its calls inside an unclosed block, and they belong to the content (where the
      tool parser finds them). A `<tool_call>` tag not followed by that is reasoning text.
- Tags are matched in the text, not token ids. The tokenizer must still have `<think>` and `</think>` as tokens
  (ReasoningParser refuses it otherwise); None skips that check.

Streaming holds back only a possible partial tag at the end of the buffer (e.g. "</thi"), never more; for Qwen3 also
a `<tool_call>` until what follows it shows whether a call starts.
"""
from __future__ import annotations

import re

from tokenmill.parsers.text_utils import partial_tag_len
from tokenmill.parsers.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"
_FUNCTION = "<function"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")
_NEWLINES = "\r\n"

# Stream modes.
_PRE = "pre"              # Qwen3 only: not yet known whether the output opens with <think>
_REASONING = "reasoning"  # inside the reasoning block
_CONTENT = "content"      # the answer




def _content(text: str) -> str | None:
    return text.lstrip(_NEWLINES) or None


class ThinkTagStream(ReasoningStream):
    """Streaming state for one request; see the module docstring for the rules.

    `reasoning_ended` is True once the answer has started: after `</think>`, immediately when the output starts as
    content (thinking disabled), and for Qwen3 without a prompt-opened block as soon as the output is known not to
    start with `<think>`. While it is still undecided (only newlines or a prefix of `<think>` seen) it is False.
    """

    def __init__(self, mode: str, tool_call_ends: bool = False) -> None:
        self._mode = mode
        self._tool_call_ends = tool_call_ends
        self._buf = ""
        self._content_started = False  # leading newlines of the content are dropped until this is set

    @property
    def reasoning_ended(self) -> bool:
        return self._mode == _CONTENT

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == _PRE:
                self._buf = self._buf.lstrip(_NEWLINES)
                if self._buf.startswith(THINK_START):
                    self._buf = self._buf[len(THINK_START):]
                    self._mode = _REASONING
                    continue
                if not final and THINK_START.startswith(self._buf):
                    break  # empty, or a partial "<think>": wait
                self._mode = _CONTENT
                continue
            if self._mode == _REASONING:
                i = self._buf.find(THINK_START)
                j = self._buf.find(THINK_END)
                t = self._buf.find(TOOL_CALL) if self._tool_call_ends else -1
                if t >= 0 and all(x < 0 or t < x for x in (i, j)):
                    after = self._buf[t + len(TOOL_CALL):].lstrip()
                    if _FUNCTION_OPEN.match(after):        # a call: it and all after it are content
                        reasoning.append(self._buf[:t])
                        self._buf = self._buf[t:]
                        self._mode = _CONTENT
                        continue
                    if not final and _FUNCTION.startswith(after):
                        reasoning.append(self._buf[:t])    # undecided: hold the tag back
                        self._buf = self._buf[t:]
                        break
                    reasoning.append(self._buf[:t + len(TOOL_CALL)])   # a mention, not a call
                    self._buf = self._buf[t + len(TOOL_CALL):]
                    continue
                if j >= 0 and (i < 0 or j < i):
                    reasoning.append(self._buf[:j])
                    self._buf = self._buf[j + len(THINK_END):]
                    self._mode = _CONTENT
                    continue
                if i >= 0:  # a repeated opening tag inside the block: dropped
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(THINK_START):]
                    continue
                tags = (THINK_START, THINK_END, TOOL_CALL) if self._tool_call_ends else (THINK_START, THINK_END)
                keep = 0 if final else partial_tag_len(self._buf, tags)
                cut = len(self._buf) - keep
                reasoning.append(self._buf[:cut])
                self._buf = self._buf[cut:]
                break
            # _CONTENT
            if not self._content_started:
                self._buf = self._buf.lstrip(_NEWLINES)
                if not self._buf:
                    break
                self._content_started = True
            content.append(self._buf)
            self._buf = ""
            break
        return ReasoningDelta(reasoning="".join(reasoning), content="".join(content))


class _ThinkTagReasoningParser(ReasoningParser):
    """`<think>...</think>` splitting; subclasses choose whether the output starts inside the reasoning block."""

    #: True: the output is reasoning from its first character (DeepSeek-R1's template opens the block).
    always_starts_in_reasoning: bool = False
    #: True: a Qwen3-Coder-form tool call inside the reasoning block ends it (see the module docstring).
    tool_call_ends_reasoning: bool = False
    required_tokens = (THINK_START, THINK_END)

    def _initial_mode(self, prompt_opens_reasoning: bool, enabled: bool) -> str:
        if not enabled:
            return _CONTENT
        if self.always_starts_in_reasoning or prompt_opens_reasoning:
            return _REASONING
        return _PRE

    def extract(self, text: str, prompt_opens_reasoning: bool = False,
                enabled: bool = True) -> tuple[str | None, str | None]:
        mode = self._initial_mode(prompt_opens_reasoning, enabled)
        if self.tool_call_ends_reasoning and mode != _CONTENT:
            # The rules this adds depend on what follows a tag: one pass of the stream keeps them in one place.
            stream = self.new_stream(prompt_opens_reasoning, enabled)
            first, last = stream.feed(text), stream.finish()
            return (first.reasoning + last.reasoning) or None, (first.content + last.content) or None
        if mode == _CONTENT:
            return None, _content(text)
        if mode == _PRE:
            stripped = text.lstrip(_NEWLINES)
            if not stripped.startswith(THINK_START):
                return None, _content(text)
            text = stripped[len(THINK_START):]
        reasoning, end_tag, rest = text.partition(THINK_END)
        reasoning = reasoning.replace(THINK_START, "")
        return reasoning or None, (_content(rest) if end_tag else None)

    def new_stream(self, prompt_opens_reasoning: bool = False, enabled: bool = True) -> ThinkTagStream:
        return ThinkTagStream(self._initial_mode(prompt_opens_reasoning, enabled), self.tool_call_ends_reasoning)

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """True when the prompt ends inside an unclosed `<think>` (its last `<think>` is after its last `</think>`)."""
        return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class DeepSeekR1ReasoningParser(_ThinkTagReasoningParser):
    """DeepSeek-R1 (and distills): the output is reasoning up to `</think>`, with or without an opening `<think>`;
    without `</think>` it is all reasoning (content None). Content is what follows `</think>`, leading newlines
    stripped. `enabled=False` makes it all content."""

    name = "deepseek_r1"
    always_starts_in_reasoning = True


class Qwen3ReasoningParser(_ThinkTagReasoningParser):
    """Qwen3: reasoning is the `<think>...</think>` block the output starts with (or, when the prompt opened the
    block, everything up to `</think>` or a Qwen3-Coder-form tool call); no opening tag means all content; an
    unclosed block is all reasoning. `enabled=False` (enable_thinking false: the template put an empty think block
    in the prompt) is all content."""

    name = "qwen3"
    always_starts_in_reasoning = False
    tool_call_ends_reasoning = True

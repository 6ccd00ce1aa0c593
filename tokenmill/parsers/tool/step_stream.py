"""The skeleton shared by the state-machine tool-call streams (llama3_json, mistral, deepseek_v3, pythonic)."""
from __future__ import annotations

import abc
from typing import Callable

from tokenmill.parsers.tool import (ExtractedToolCalls, ToolCall, ToolParser, ToolStream, ToolStreamDelta,
                                    make_tool_call_id)

PLAIN, DONE = -1, -2  # terminal states: the rest is content / nothing more to read


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class StepToolStream(ToolStream):
    """A stream over a growing buffer driven by a small state machine.

    Subclasses start in `start_state` and map each live state to a step method through `_steps()`; a step gets
    (delta being built, final) and returns True when it moved on (run the next step now) or False when it needs more
    text. `_pos` marks the start of text not yet emitted or dropped; in PLAIN everything from there is content.
    `extract()` of the matching parser is feed(text) + finish(), so streamed and whole results are the same code.
    """

    def __init__(self, start_state: int) -> None:
        self._buf = ""
        self._pos = 0
        self._state = start_state
        self._calls = 0
        self._finished = False
        self._step_table = self._steps()

    @abc.abstractmethod
    def _steps(self) -> dict[int, Callable[[ToolStreamDelta, bool], bool]]: ...

    def feed(self, delta_text: str) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if not self._finished and delta_text:
            self._buf += delta_text
            self._run(out, final=False)
        return out

    def finish(self) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if not self._finished:
            self._finished = True
            self._run(out, final=True)
        return out

    def _run(self, out: ToolStreamDelta, final: bool) -> None:
        step = self._step_table
        while self._state in step:
            if not step[self._state](out, final):
                break
        if self._state == PLAIN:
            out.content += self._buf[self._pos:]
            self._pos = len(self._buf)

    def _goto(self, state: int, pos: int) -> bool:
        self._state, self._pos = state, pos
        return True


def collect(deltas: list[ToolStreamDelta]) -> ExtractedToolCalls:
    """Fold stream deltas into the non-streamed result."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.index not in calls:
                calls[tc.index] = ToolCall(name=tc.name or "", arguments="", id=tc.id or make_tool_call_id())
            calls[tc.index].arguments += tc.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    return ExtractedToolCalls(tools_called=bool(tool_calls), tool_calls=tool_calls, content=content or None)


class StepToolParser(ToolParser):
    """A parser whose whole-text result is its stream fed everything at once (`stream_cls` says which stream)."""

    stream_cls: type[StepToolStream]

    def extract(self, text: str, tools: list[dict] | None = None) -> ExtractedToolCalls:
        stream = self.new_stream(tools)
        return collect([stream.feed(text), stream.finish()])

    def new_stream(self, tools: list[dict] | None = None) -> StepToolStream:
        return self.stream_cls()

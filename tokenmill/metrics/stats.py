"""What the front end gathers, per engine step, for vLLM's Prometheus metrics (and the periodic log line).

The output processor keeps a `SeqStats` per sequence (only with log_stats) and fills one `IterationStats` per
`process_outputs` call: O(1) work per output it already handles, plus one record per finished sequence. Intervals
inside a request (queue, prefill, decode, inference, inter-token) come from the engine core's clock (its
`RequestStartStats` and each step's `EngineCoreOutputs.timestamp`); TTFT and end-to-end latency come from the
front end's wall clock against the request's arrival time, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.messages import EngineCoreOutput


class SeqStats:
    """One sequence's state across steps: the core's start record, first and latest token times (core clock),
    tokens generated, prompt tokens found in the prefix cache, and the max_tokens it ran with."""

    __slots__ = ("queued_ts", "scheduled_ts", "first_ts", "last_ts", "num_generation_tokens", "num_cached_tokens",
                 "max_tokens")

    def __init__(self, max_tokens: int | None) -> None:
        self.queued_ts: float | None = None
        self.scheduled_ts: float | None = None
        self.first_ts = self.last_ts = 0.0
        self.num_generation_tokens = 0
        self.num_cached_tokens = 0
        self.max_tokens = max_tokens


@dataclass
class FinishedRequestStats:
    """One finished sequence. The phase times are None where the request never got that far: no queue time if
    the core never reported scheduling it, no prefill/decode/inference time without a token, no mean time per
    output token with fewer than two."""
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    mean_time_per_output_token: float | None = None


@dataclass
class IterationStats:
    """What one `process_outputs` call saw.

    `now` is the front end's time.time() for the call, `engine_ts` the core's timestamp of the outputs. Prompt
    tokens are counted per sequence at its first token, split the way vLLM does: `prompt_tokens_computed` (prompt
    minus cache hits), `prompt_tokens_cached` (hits) and `prompt_tokens_recomputed` (cached tokens computed anyway);
    the local cache source is cached + recomputed. Inter-token latencies are kept as {seconds: count}: in a steady
    batch every sequence shares the previous step's timestamp, so a step yields one or two distinct values.
    """
    now: float = 0.0
    engine_ts: float = 0.0
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_recomputed: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: dict[float, int] = field(default_factory=dict)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    n_params: list[int] = field(default_factory=list)  # per finished user request
    max_num_generation_tokens: list[int] = field(default_factory=list)  # per finished user request: its longest

    def observe_output(self, s: SeqStats, eco: EngineCoreOutput, num_new: int, prompt_len: int,
                       arrival_time: float) -> None:
        """One engine-core output of a sequence that carried `num_new` generated tokens."""
        start = eco.start_stats
        if start is not None:
            s.queued_ts, s.scheduled_ts = start.queued_ts, start.scheduled_ts
        if not num_new:
            return
        self.num_generation_tokens += num_new
        ts = self.engine_ts
        if s.num_generation_tokens == 0:
            self.time_to_first_tokens_s.append(self.now - arrival_time)
            cached = min(eco.num_cached_tokens, prompt_len)
            self.num_prompt_tokens += prompt_len
            self.prompt_tokens_computed += prompt_len - cached
            self.prompt_tokens_cached += cached
            if start is not None:
                self.prompt_tokens_recomputed += start.num_recomputed_tokens
            s.num_cached_tokens = cached
            s.first_ts = ts
        else:
            itl = ts - s.last_ts
            d = self.inter_token_latencies_s
            d[itl] = d.get(itl, 0) + 1
        s.last_ts = ts
        s.num_generation_tokens += num_new

    def observe_finished(self, s: SeqStats, reason: str, prompt_len: int, arrival_time: float) -> None:
        f = FinishedRequestStats(reason, self.now - arrival_time, prompt_len, s.num_generation_tokens,
                                 s.num_cached_tokens, s.max_tokens)
        if s.scheduled_ts is not None and s.queued_ts is not None:
            f.queued_time = s.scheduled_ts - s.queued_ts
            n = s.num_generation_tokens
            if n:
                f.prefill_time = s.first_ts - s.scheduled_ts
                f.decode_time = s.last_ts - s.first_ts
                f.inference_time = s.last_ts - s.scheduled_ts
                if n > 1:
                    f.mean_time_per_output_token = f.decode_time / (n - 1)
        self.finished.append(f)

    def observe_parent_finished(self, n: int, num_generation_tokens: list[int]) -> None:
        self.n_params.append(n)
        self.max_num_generation_tokens.append(max(num_generation_tokens, default=0))

"""Outputs returned to users, shaped like vLLM's `RequestOutput` / `CompletionOutput`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability at one position: its value, its rank (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    time_in_queue: float | None = None  # seconds from the engine core receiving it to its first scheduling

    @property
    def first_token_latency(self) -> float:
        """Seconds from arrival to the first token (vLLM V1's RequestStateStats name; 0.0 before it)."""
        return 0.0 if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the n sequences generated for a request."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    lora_request: object | None = None  # the LoRARequest it was generated under, as in vLLM

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, finish_reason={self.finish_reason}, "
                f"stop_reason={self.stop_reason})")


@dataclass
class RequestOutput:
    """Everything known about one request so far (or at the end, for offline generation)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = 0
    kv_transfer_params: dict | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    lora_request: object | None = None
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished}, "
                f"num_cached_tokens={self.num_cached_tokens})")

"""Typed messages between the front end (processor / output processor) and the engine core.

They are msgspec structs so the same objects cross the ZMQ boundary in serving and are passed directly in-process
for offline `LLM`. They live in core/ because the scheduler is the lowest layer that builds and reads them (the
sampler, the model runner and the metrics use LogprobsLists and the stats too); the engine imports them from here.
"""
from __future__ import annotations

import enum

import msgspec

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0    # a stop token, EOS or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2   # aborted by the client or the engine

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized, validated request handed to the engine core."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (see core/block_hash.py)
    lora_request: LoRARequest | None = None  # the adapter it runs under (its prefix-cache entries are its own)


class LogprobsLists(msgspec.Struct, array_like=True):
    """Logprobs for a run of positions.

    For each position i: token_ids[i][0] is the chosen (sampled or prompt) token and token_ids[i][1:] the top-N
    tokens in descending order; logprobs[i] matches token_ids[i]; ranks[i] is the chosen token's rank (1 = best).
    """
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def __len__(self) -> int:
        return len(self.ranks)


class RequestStartStats(msgspec.Struct, array_like=True):
    """The core's record of how a request started, sent once with its first generated token (for metrics).

    Times are the engine core's time.monotonic(), comparable only with each other and with
    `EngineCoreOutputs.timestamp` of the same core (a headless node's clock is not the API server's).
    """
    queued_ts: float           # the core received the request
    scheduled_ts: float        # first scheduled (a later preemption does not move it)
    num_recomputed_tokens: int = 0  # cached prompt tokens computed again (a forward needs one new token)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    start_stats: RequestStartStats | None = None  # last: omitted from the wire on every later output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, omit_defaults=True):
    """Speculative decoding since the previous snapshot, as vLLM counts it: drafts verified (requests x steps
    with at least one draft), draft tokens verified, of which accepted, and accepted per draft position."""
    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    def take(self) -> "SpecDecodingStats":
        """This snapshot; the counters start again from zero."""
        out = SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        return out


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """A snapshot for logging and metrics."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0     # of which were found
    num_preemptions: int = 0
    num_batched_tokens: int = 0    # tokens scheduled since the previous snapshot (vllm:iteration_tokens_total)
    num_deferred_reqs: int = 0     # of the waiting requests, those held back by a transient constraint (a grammar
                                   # still compiling) rather than by capacity
    # LoRA (enable_lora): adapter name -> requests under it, running and waiting (vllm:lora_requests_info).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    spec_decoding_stats: SpecDecodingStats | None = None  # speculative decoding since the previous snapshot


def combine_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats | None:
    """The stats of several data-parallel engines as one snapshot: counts summed, KV usage averaged."""
    if not stats:
        return None
    if len(stats) == 1:
        return stats[0]
    return SchedulerStats(num_running_reqs=sum(s.num_running_reqs for s in stats),
                          num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
                          kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
                          prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
                          prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
                          num_preemptions=sum(s.num_preemptions for s in stats),
                          num_batched_tokens=sum(s.num_batched_tokens for s in stats),
                          num_deferred_reqs=sum(s.num_deferred_reqs for s in stats))


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine step's outputs; `engine_index` is the data-parallel rank of the engine core that sent them."""
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0
